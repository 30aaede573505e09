"""How processes find and talk to each other: Mesh, spawn, counted comm.

The names load on first use (PEP 562): ``tessera.runtime.link`` (link profiles, pure
Python) is importable without torch, as the command line's parsers need."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.runtime.lazy import lazy_names

_WHERE = {
    "Comm": "tessera.runtime.comm",
    "Ledger": "tessera.runtime.ledger",
    "Mesh": "tessera.runtime.mesh",
    "RankError": "tessera.runtime.launch",
    "init_from_env": "tessera.runtime.launch",
    "spawn": "tessera.runtime.launch",
}

__all__ = ["Comm", "Ledger", "Mesh", "RankError", "init_from_env", "spawn"]


__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)


if TYPE_CHECKING:  # for type checkers and editors: the same names, eagerly
    from tessera.runtime.comm import Comm
    from tessera.runtime.launch import RankError, init_from_env, spawn
    from tessera.runtime.ledger import Ledger
    from tessera.runtime.mesh import Mesh
