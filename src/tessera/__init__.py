"""Tessera: cut large models and their work into tiles and spread them over devices."""

from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_denoise, parallel_sample
from tessera.runtime import Mesh, RankError, spawn

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "ParallelConfig",
    "RankError",
    "__version__",
    "parallel_denoise",
    "parallel_sample",
    "spawn",
]
