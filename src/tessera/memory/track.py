"""Memory measurement, the one place every benchmark and recipe takes it from.

Resident memory (Linux ``/proc/self/status``): ``resident_bytes`` now, ``peak_resident_bytes``
the high-water mark (VmHWM), ``reset_peak_rss`` to restart it, ``rss_peak_during(fn)`` the
peak a function adds. Run measuring children with ``fresh_process_env``: glibc then returns
freed blocks to the OS, so a later peak is not hidden by memory kept from an earlier one.

Live tensor memory, tracked at the ATen dispatch level (works on CPU, CUDA and fake tensors):
``TensorMemory`` sees every ATen op's outputs and holds the bytes of each new storage until
that storage dies: the peak of live tensor memory the code under it added, exactly and
deterministically. It does not see memory an op allocates and frees inside one kernel, nor
allocator overheads; storages that existed before (inputs, parameters) are not counted, and
neither are views of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

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


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    return status_kib("VmRSS") * 1024


def peak_resident_bytes() -> int:
    """This process's resident high-water mark (VmHWM) since start or the last reset."""
    return status_kib("VmHWM") * 1024


def rss_peak_during(fn: Callable[[], object]) -> tuple[int, object]:
    """(peak resident bytes above the resident bytes before, fn's result)."""
    before = reset_peak_rss()
    result = fn()
    return (status_kib("VmHWM") - before) * 1024, result


def fresh_process_env(threads: int = 1) -> dict[str, str]:
    """Environment for a measuring child: freed blocks above 64 KiB go back to the OS."""
    env = dict(os.environ)
    env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS=str(threads))
    return env
