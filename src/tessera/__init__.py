"""Tessera: cut large models and their work into tiles and spread them over devices."""

from tessera.runtime import Mesh, RankError, spawn

__version__ = "0.1.0"

__all__ = ["Mesh", "RankError", "spawn", "__version__"]
