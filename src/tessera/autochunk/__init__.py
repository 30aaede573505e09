"""AutoChunk: compute activation-heavy regions of a traced graph in slices (torch.fx)."""

from tessera.autochunk.api import AutoChunked, autochunk, estimate_peak
from tessera.autochunk.search import BudgetError, Plan

__all__ = ["AutoChunked", "BudgetError", "Plan", "autochunk", "estimate_peak"]
