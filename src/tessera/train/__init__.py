"""Plan, boost(), the training loop's parts, checkpoints and resuming.

The names load on first use (PEP 562): importing ``tessera.train`` imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.runtime.lazy import lazy_names

_WHERE = {
    "Checkpointer": "tessera.train.resume",
    "resume_or_start": "tessera.train.resume",
}

__all__ = ["Checkpointer", "resume_or_start"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)

if TYPE_CHECKING:  # for type checkers and editors: the same names, eagerly
    from tessera.train.resume import Checkpointer, resume_or_start
