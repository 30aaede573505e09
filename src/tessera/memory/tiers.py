"""Memory tiers, each with a byte budget: the accelerator, host memory, disk.

A ``Tier`` only counts: it knows its budget and how many bytes chunks hold on it, and
refuses a reservation past the budget with an error naming the tier, the request and the
budget. What moves bytes between tiers is ``tessera.memory.store``; what decides which
chunk goes where is ``tessera.memory.placement``.

The disk tier is ZeRO-Infinity's NVMe offload: one file per chunk under a directory the
user names, each chunk written and read whole, in one sequential call (``readinto``
straight into the chunk's own storage: no staging copy on CPU). Its budget is the free
space of its file system, checked before training starts.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch


class TierFull(MemoryError):
    """A tier has no room for a request, even after every movable chunk left it."""


@dataclass
class Tier:
    name: str  # "device", "host" or "disk"
    budget: int | None  # bytes; None: unbounded
    device: torch.device
    used: int = 0
    peak: int = 0
    # measuring (the warm-up step): a request past the budget is granted and recorded in
    # ``shortfall`` instead of raised, so that the engine can refuse before the first
    # optimizer step with the numbers rather than fail in the middle of one
    measuring: bool = False
    shortfall: tuple[int, str] | None = None  # (bytes held at once, the request that made it)

    def room(self) -> float:
        return float("inf") if self.budget is None else self.budget - self.used

    def reserve(self, nbytes: int, what: str = "a chunk") -> None:
        if nbytes > self.room():
            if not self.measuring:
                raise TierFull(
                    f"{self.name} tier: {what} needs {nbytes} bytes, {self.used} of the budget of {self.budget} "
                    f"are held by chunks in use; raise Plan.{self.name}_memory or make chunks smaller "
                    "(Plan.chunk_mib)"
                )
            if self.shortfall is None or self.used + nbytes > self.shortfall[0]:
                self.shortfall = (self.used + nbytes, what)
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        assert nbytes <= self.used, (self.name, nbytes, self.used)
        self.used -= nbytes


def check_dir(path: str | os.PathLike, need: int) -> Path:
    """The offload directory, made if missing, refused (one line, with the numbers) if it is
    not writable or its file system has less than ``need`` bytes free."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(
            f"Plan.offload_dir={str(path)!r} is not a writable directory ({e.strerror})"
        ) from None
    free = shutil.disk_usage(path).free
    if free < need:
        raise ValueError(
            f"Plan.offload_dir={str(path)!r} has {free} bytes free, the plan writes {need}; "
            "free space there or choose another directory"
        )
    return path


class DiskTier(Tier):
    """Chunks as files ``<dir>/<key>.bin``; the budget is the free space at construction."""

    def __init__(self, directory: str | os.PathLike, need: int):
        self.dir = check_dir(directory, need)
        super().__init__("disk", shutil.disk_usage(self.dir).free, torch.device("cpu"))

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.bin"

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """``tensor`` (contiguous, on the CPU) to its file in one sequential write."""
        with open(self.path(key), "wb", buffering=0) as f:
            f.write(_bytes(tensor))

    def read_into(self, key: str, tensor: torch.Tensor) -> None:
        """The file into ``tensor``'s own storage, in one sequential read (the GIL is
        released while the kernel copies, so a prefetch thread overlaps compute)."""
        view = _bytes(tensor)
        with open(self.path(key), "rb", buffering=0) as f:
            got = f.readinto(view)
        assert got == len(view), (key, got, len(view))

    def remove(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def close(self) -> None:
        for f in self.dir.glob("*.bin"):
            f.unlink(missing_ok=True)


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, in place (through ctypes, not ``.numpy()``: a storage numpy has
    seen can no longer be resized, and eviction resizes it to zero)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    n = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * n).from_address(tensor.data_ptr())).cast("B")
