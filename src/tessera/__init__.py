"""Tessera: cut large models and their work into tiles and spread them over devices.

The public names load on first use (PEP 562), so ``import tessera`` and the command line's
``--help`` do not pay for torch, transformers and diffusers until something needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.runtime.lazy import lazy_names

__version__ = "0.1.0"

_WHERE = {
    "Mesh": "tessera.runtime",
    "RankError": "tessera.runtime",
    "spawn": "tessera.runtime",
    "ParallelConfig": "tessera.diffusion.layout",
    "parallel_denoise": "tessera.diffusion.parallel",
    "parallel_sample": "tessera.diffusion.parallel",
    "Plan": "tessera.plan.training_plan",
    "boost": "tessera.train.boost",
    "autochunk": "tessera.autochunk",
}

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


__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)


if TYPE_CHECKING:  # for type checkers and editors: the same names, eagerly
    from tessera.autochunk import autochunk
    from tessera.diffusion.layout import ParallelConfig
    from tessera.diffusion.parallel import parallel_denoise, parallel_sample
    from tessera.plan.training_plan import Plan
    from tessera.runtime import Mesh, RankError, spawn
    from tessera.train.boost import boost
