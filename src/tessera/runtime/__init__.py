"""How processes find and talk to each other: Mesh, spawn, counted comm."""

from tessera.runtime.comm import Comm, Ledger
from tessera.runtime.launch import RankError, init_from_env, spawn
from tessera.runtime.mesh import Mesh

__all__ = ["Comm", "Ledger", "Mesh", "RankError", "init_from_env", "spawn"]
