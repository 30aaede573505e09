"""Mesh: named parallel axes over torch.distributed process groups.

``Mesh(dp=2, pp=2)`` lays the world's ranks out row-major over the axes in the order
given (the last axis varies fastest, as in torch's DeviceMesh), keeps one sub-group per
axis and this rank's coordinate on each. A Mesh is an ordinary object passed to whatever
needs it: two meshes can live in one process, and a Mesh whose axes all have size 1
works without any process group at all (single-process tests and CPU laptops).
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import time
from functools import cached_property

import torch
import torch.distributed as dist

from tessera.runtime.comm import Comm


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# (world group id, device type, layout) -> (the world group, its DeviceMesh): see _build_device_mesh
_DEVICE_MESHES: dict[tuple, tuple] = {}


def release_device_meshes() -> None:
    """Drop the DeviceMeshes kept here (and torch's own references to meshes), then collect:
    a process group destroyed by ``destroy_process_group`` is only unregistered, its gloo
    threads end when the last reference goes. Left to the interpreter's finalisation, that
    end can abort the process ('terminate called without an active exception', SIGABRT: seen
    in 1 of 6-8 runs of a two-rank script here), so this runs at exit, while the interpreter is
    whole."""
    import gc

    _DEVICE_MESHES.clear()
    resources = getattr(torch.distributed.device_mesh, "_mesh_resources", None)
    for name in ("mesh_stack", "child_to_root_mapping", "root_to_flatten_mapping", "flatten_name_to_root_dims"):
        held = getattr(resources, name, None)
        if hasattr(held, "clear"):
            held.clear()
    gc.collect()
    let_runnable_threads_park()


def let_runnable_threads_park(timeout_s: float = 0.5) -> bool:
    """Sleep until no other thread of this process is runnable (Linux's /proc), ``timeout_s``
    at most; True when none was left runnable. A gloo worker drops its finished collective
    (and the tensors it holds) only after the collective has woken the caller; on busy cores
    that worker can stay preempted until the interpreter is finalising, and a tensor freed
    then aborts the process (the same SIGABRT; a core dump shows ``~AsyncAllgatherWork`` in
    ``ProcessGroupGloo::runLoop`` taking the GIL inside ``Py_FinalizeEx``). Sleeping here hands
    such a worker the core while the interpreter is whole."""
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        return True
    me = str(threading.get_native_id())
    deadline = time.monotonic() + timeout_s
    while True:
        runnable = False
        for tid in os.listdir(tasks):
            if tid == me:
                continue
            try:
                with open(f"{tasks}/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]  # the field after "(name)"
            except (OSError, IndexError):
                continue  # the thread ended meanwhile
            runnable |= state == "R"
        if not runnable:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


atexit.register(release_device_meshes)


class Mesh:
    """Named axes over the world's ranks; see the module docstring."""

    def __init__(self, **axes: int):
        if not axes:
            raise ValueError("Mesh needs at least one axis, e.g. Mesh(dp=2)")
        for name, size in axes.items():
            if not name.isidentifier():
                raise ValueError(f"mesh axis name {name!r} is not an identifier")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"mesh axis {name}={size!r}: sizes must be integers >= 1")
        product = math.prod(axes.values())
        world = world_size()
        if product != world:
            shape = " x ".join(f"{k}={v}" for k, v in axes.items())
            raise ValueError(
                f"mesh {shape} has {product} ranks but the world size is {world}; "
                f"choose axis sizes whose product is {world}"
            )
        self.axes: dict[str, int] = dict(axes)
        self.names: tuple[str, ...] = tuple(axes)
        self.global_rank = global_rank()
        self._device_mesh = self._build_device_mesh() if world > 1 else None
        self.comm = Comm(self)

    def _build_device_mesh(self):
        """torch's DeviceMesh of this layout: made once per process group world and layout,
        then shared by every Mesh of that layout. Process groups are resources of the process
        (each gloo group keeps threads; the ranks of a layout are the same whoever asks), and
        DTensor keys its caches on a mesh's layout, so one mesh per layout keeps them true."""
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        key = (id(dist.group.WORLD), device_type, tuple(self.axes.items()))
        made = _DEVICE_MESHES.get(key)
        if made is None or made[0] is not dist.group.WORLD:
            made = _DEVICE_MESHES[key] = (
                dist.group.WORLD,
                init_device_mesh(device_type, tuple(self.axes.values()), mesh_dim_names=self.names),
            )
        return made[1]

    def _check_axis(self, axis: str) -> None:
        if axis not in self.axes:
            raise ValueError(f"mesh has no axis {axis!r}; its axes are {list(self.names)}")

    def size(self, axis: str | None = None) -> int:
        """Ranks along ``axis`` (all ranks when ``axis`` is None)."""
        if axis is None:
            return math.prod(self.axes.values())
        self._check_axis(axis)
        return self.axes[axis]

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self.coords[axis]

    @cached_property
    def coords(self) -> dict[str, int]:
        coords: dict[str, int] = {}
        remainder = self.global_rank
        for name in reversed(self.names):
            coords[name] = remainder % self.axes[name]
            remainder //= self.axes[name]
        return {name: coords[name] for name in self.names}

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of the ranks that share every coordinate but ``axis``'s."""
        self._check_axis(axis)
        if self._device_mesh is None:
            return None
        return self._device_mesh.get_group(axis)

    def global_rank_of(self, axis: str, axis_rank: int) -> int:
        """Global rank of the peer at coordinate ``axis_rank`` along ``axis`` (others equal)."""
        self._check_axis(axis)
        if not 0 <= axis_rank < self.axes[axis]:
            raise ValueError(f"{axis} rank {axis_rank} is outside 0..{self.axes[axis] - 1}")
        stride = math.prod(self.axes[n] for n in self.names[self.names.index(axis) + 1 :])
        return self.global_rank + (axis_rank - self.coords[axis]) * stride

    @property
    def device_mesh(self):
        """torch's DeviceMesh over the same layout (None when single-process)."""
        return self._device_mesh

    @property
    def device(self) -> torch.device:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __repr__(self) -> str:
        shape = ", ".join(f"{k}={v}" for k, v in self.axes.items())
        return f"Mesh({shape}; rank {self.global_rank} at {self.coords})"
