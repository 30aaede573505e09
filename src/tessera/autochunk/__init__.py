"""AutoChunk: compute activation-heavy regions of a traced graph in slices (torch.fx).

``tessera.autochunk`` is both this package and the function ``autochunk``: the package is
callable, so ``tessera.autochunk(model, ...)`` works whether or not a submodule was
imported first (an import of ``tessera.autochunk.api`` makes ``tessera.autochunk`` the
package, which would otherwise hide the function the top-level name promises)."""

import sys
import types

from tessera.autochunk.api import AutoChunked, autochunk, estimate_peak
from tessera.autochunk.search import BudgetError, ChunkPlan

__all__ = ["AutoChunked", "BudgetError", "ChunkPlan", "autochunk", "estimate_peak"]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return autochunk(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
