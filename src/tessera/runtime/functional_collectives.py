"""The collectives torch's DTensor issues (``_c10d_functional`` ops, which bypass
``tessera.runtime.comm.Comm``), seen by a dispatch mode and counted in ``Comm``'s
convention, with the emulated link time when the ``Comm`` has a link model."""

from __future__ import annotations

import torch

from tessera.runtime.comm import Comm
from tessera.runtime.ledger import nbytes

_FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


class FunctionalCollectives(torch.utils._python_dispatch.TorchDispatchMode):
    """Sees the collectives torch's DTensor issues (``_c10d_functional`` ops, which bypass
    ``Comm``) and lists them as (operation, bytes) in ``Comm``'s convention. Given the
    ``comm`` and mesh ``axis`` they run on, it also gives each the emulated link time when
    ``comm`` has a link model, waited at issue (their waits happen below dispatch, out of
    sight; DTensor's tensor parallel uses each result at once, so this is when it would wait)."""

    def __init__(self, comm: Comm | None = None, axis: str | None = None):
        super().__init__()
        self.comm, self.axis = comm, axis
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1] if func.namespace == "_c10d_functional" else None
        out = func(*args, **(kwargs or {}))
        if name in _FUNCTIONAL_OPS:
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            self.calls.append((_FUNCTIONAL_OPS[name], sum(nbytes(t) for t in tensors)))
            if self.comm is not None:
                op, num_bytes = self.calls[-1]
                self.comm._emulate_sync(op, self.axis, num_bytes)
        return out
