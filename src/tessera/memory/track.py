"""Live tensor memory, tracked at the ATen dispatch level (works on CPU, CUDA and fake tensors).

``TensorMemory`` sees every ATen op's outputs and holds the bytes of each new storage until
that storage dies: the peak of live tensor memory the code under it added, exactly and
deterministically. It does not see memory an op allocates and frees inside one kernel, nor
allocator overheads; storages that existed before (inputs, parameters) are not counted, and
neither are views of them.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMemory(TorchDispatchMode):
    """``with TensorMemory() as mem: f()`` then ``mem.peak`` (bytes above what existed before)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _collect(self) -> None:
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._collect()
        seen = {
            StorageWeakRef(t.untyped_storage()).cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref.cdata in self.live or ref.cdata in seen:
                continue
            self.live[ref.cdata] = (ref, storage.nbytes())
            self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (e.g. "VmRSS", "VmHWM"); 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak_rss() -> int:
    """Reset the resident-set high-water mark (VmHWM) to now; returns VmRSS in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS")
