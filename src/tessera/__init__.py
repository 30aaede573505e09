"""Tessera: cut large models and their work into tiles and spread them over devices."""

from tessera.autochunk import autochunk
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_denoise, parallel_sample
from tessera.runtime import Mesh, RankError, spawn
from tessera.train.boost import boost
from tessera.train.plan import Plan

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "ParallelConfig",
    "Plan",
    "RankError",
    "__version__",
    "autochunk",
    "boost",
    "parallel_denoise",
    "parallel_sample",
    "spawn",
]
