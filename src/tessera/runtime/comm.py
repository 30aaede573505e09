"""Every collective and point-to-point call of the library, counted.

Each call records the payload bytes *this rank* hands to (or receives from) the network
layer, under its operation kind and mesh axis. The convention, which the benchmarks'
analytic formulas follow too:

    all_reduce      bytes of the tensor
    all_gather      bytes of this rank's input shard
    reduce_scatter  bytes of this rank's full input
    all_to_all      bytes of this rank's input
    broadcast       bytes of the tensor (on every rank, source included)
    send / recv     bytes sent / bytes received

Along an axis of size 1 nothing moves, so nothing is called and nothing is counted.
The pseudo-axis ``"world"`` spans every rank of the mesh (the default process group).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from tessera.runtime.mesh import Mesh


# torch 2.13 renamed the flat collectives; older releases (e.g. on a GPU image) have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


WORLD = "world"


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Ledger:
    """Bytes and call counts per (operation, axis)."""

    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def record(self, op: str, axis: str, num_bytes: int) -> None:
        self.bytes[(op, axis)] += num_bytes
        self.calls[(op, axis)] += 1

    def total(self, *, op: str | None = None, axis: str | None = None) -> int:
        return sum(
            b for (o, a), b in self.bytes.items() if (op is None or o == op) and (axis is None or a == axis)
        )

    def count(self, *, op: str | None = None, axis: str | None = None) -> int:
        return sum(
            c for (o, a), c in self.calls.items() if (op is None or o == op) and (axis is None or a == axis)
        )

    def snapshot(self) -> dict[str, dict[str, int]]:
        """{"op@axis": {"bytes": ..., "calls": ...}}, JSON-ready."""
        return {
            f"{o}@{a}": {"bytes": self.bytes[(o, a)], "calls": self.calls[(o, a)]}
            for (o, a) in sorted(self.bytes)
        }

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


class Comm:
    """Counted collectives over the axes of one Mesh."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.ledger = Ledger()

    def _size(self, axis: str) -> int:
        return self.mesh.size() if axis == WORLD else self.mesh.size(axis)

    def _group(self, axis: str):
        return None if axis == WORLD else self.mesh.group(axis)

    def _moves(self, axis: str) -> bool:
        return self._size(axis) > 1

    def all_reduce(self, t: torch.Tensor, axis: str, *, op: str = "sum", async_op: bool = False):
        """In place. ``op`` is "sum", "avg" (done as sum then divide: gloo has no AVG on
        every dtype) or "max"."""
        if op not in ("sum", "avg", "max"):
            raise ValueError(f"all_reduce op must be 'sum', 'avg' or 'max', got {op!r}")
        if not self._moves(axis):
            return None
        self.ledger.record("all_reduce", axis, nbytes(t))
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        work = dist.all_reduce(t, reduce_op, group=self.mesh.group(axis), async_op=async_op)
        if op == "avg":
            assert not async_op, "avg is only offered synchronously"
            t.div_(self.mesh.size(axis))
        return work

    def all_gather(self, t: torch.Tensor, axis: str, *, dim: int = 0) -> torch.Tensor:
        """Concatenation along ``dim`` of every rank's ``t`` (equal shapes), in axis order.
        Differentiable: the gradient is reduce-scattered back (each rank's use summed)."""
        if torch.is_grad_enabled() and t.requires_grad and self._moves(axis):
            return _AllGather.apply(t, self, axis, dim)
        return self.all_gather_async(t, axis, dim=dim)()

    def all_gather_async(self, t: torch.Tensor, axis: str, *, dim: int = 0) -> Callable[[], torch.Tensor]:
        """Start an all_gather; the returned function waits for it and gives the result."""
        n = self.mesh.size(axis)
        if n == 1:
            return lambda: t
        self.ledger.record("all_gather", axis, nbytes(t))
        src = t.movedim(dim, 0).contiguous()
        out = torch.empty((n * src.shape[0], *src.shape[1:]), dtype=t.dtype, device=t.device)
        work = _all_gather_flat(out.view(-1), src.view(-1), group=self.mesh.group(axis), async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            return out.movedim(0, dim)

        return finish

    def reduce_scatter(self, t: torch.Tensor, axis: str, *, dim: int = 0) -> torch.Tensor:
        """Sum over ranks of ``t``, split into equal chunks along ``dim``; returns my chunk."""
        n = self.mesh.size(axis)
        if n == 1:
            return t
        if t.shape[dim] % n:
            raise ValueError(
                f"reduce_scatter: dim {dim} of size {t.shape[dim]} is not divisible by {axis}={n}"
            )
        self.ledger.record("reduce_scatter", axis, nbytes(t))
        src = t.movedim(dim, 0).contiguous()
        out = torch.empty((src.shape[0] // n, *src.shape[1:]), dtype=t.dtype, device=t.device)
        _reduce_scatter_flat(out.view(-1), src.view(-1), group=self.mesh.group(axis))
        return out.movedim(0, dim)

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, axis: str) -> None:
        """Flat, in place: ``out`` (n x shard elements) becomes every rank's ``shard`` in axis order."""
        if self.mesh.size(axis) == 1:
            out.view(-1).copy_(shard.view(-1))
            return
        self.ledger.record("all_gather", axis, nbytes(shard))
        _all_gather_flat(
            out.view(-1), shard.contiguous().view(-1), group=self.mesh.group(axis), async_op=False
        )

    def reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, axis: str) -> None:
        """Flat, in place: ``out`` becomes my 1/n of the sum over ranks of ``full``."""
        if self.mesh.size(axis) == 1:
            out.view(-1).copy_(full.view(-1))
            return
        self.ledger.record("reduce_scatter", axis, nbytes(full))
        _reduce_scatter_flat(out.view(-1), full.contiguous().view(-1), group=self.mesh.group(axis))

    def all_to_all(self, t: torch.Tensor, axis: str, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Split ``t`` into equal chunks along ``scatter_dim``, send chunk i to rank i, and
        concatenate what arrives along ``gather_dim``. Differentiable: the gradient takes the
        inverse all-to-all."""
        if torch.is_grad_enabled() and t.requires_grad and self._moves(axis):
            return _AllToAll.apply(t, self, axis, scatter_dim, gather_dim)
        return self._all_to_all(t, axis, scatter_dim=scatter_dim, gather_dim=gather_dim)

    def _all_to_all(self, t: torch.Tensor, axis: str, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        n = self.mesh.size(axis)
        if n == 1:
            return t
        if t.shape[scatter_dim] % n:
            raise ValueError(
                f"all_to_all: dim {scatter_dim} of size {t.shape[scatter_dim]} is not divisible by {axis}={n}"
            )
        self.ledger.record("all_to_all", axis, nbytes(t))
        src = t.movedim(scatter_dim, 0).contiguous()
        out = torch.empty_like(src)
        dist.all_to_all_single(out, src, group=self.mesh.group(axis))
        # out[i] holds rank i's chunk; put rank order along gather_dim.
        chunks = out.chunk(n, dim=0)
        return torch.cat([c.movedim(0, scatter_dim) for c in chunks], dim=gather_dim)

    def broadcast(self, t: torch.Tensor, axis: str, *, src: int = 0) -> torch.Tensor:
        """In place from the rank at coordinate ``src`` along ``axis``."""
        if not self._moves(axis):
            return t
        self.ledger.record("broadcast", axis, nbytes(t))
        root = src if axis == WORLD else self.mesh.global_rank_of(axis, src)
        dist.broadcast(t, root, group=self._group(axis))
        return t

    def isend(self, t: torch.Tensor, axis: str, *, dst: int) -> dist.Work:
        assert t.is_contiguous(), "send buffers must be contiguous (and kept alive until wait)"
        self.ledger.record("send", axis, nbytes(t))
        peer = self.mesh.global_rank_of(axis, dst)
        return dist.isend(t, peer, group=self.mesh.group(axis))

    def irecv(self, t: torch.Tensor, axis: str, *, src: int) -> dist.Work:
        assert t.is_contiguous(), "receive buffers must be contiguous"
        self.ledger.record("recv", axis, nbytes(t))
        peer = self.mesh.global_rank_of(axis, src)
        return dist.irecv(t, peer, group=self.mesh.group(axis))

    def barrier(self, axis: str | None = None) -> None:
        if axis is None:
            if dist.is_initialized():
                dist.barrier()
        elif self._moves(axis):
            dist.barrier(group=self.mesh.group(axis))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm: Comm, axis: str, dim: int):
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        return comm.all_gather_async(t, axis, dim=dim)()

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.reduce_scatter(grad.contiguous(), ctx.axis, dim=ctx.dim), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm: Comm, axis: str, scatter_dim: int, gather_dim: int):
        ctx.comm, ctx.axis, ctx.dims = comm, axis, (scatter_dim, gather_dim)
        return comm._all_to_all(t, axis, scatter_dim=scatter_dim, gather_dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        out = ctx.comm._all_to_all(
            grad.contiguous(), ctx.axis, scatter_dim=gather_dim, gather_dim=scatter_dim
        )
        return out, None, None, None, None


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
    ``Comm``) and lists them as (operation, bytes) in ``Comm``'s convention."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._schema.name.split("::")[-1] in _FUNCTIONAL_OPS:
            op = _FUNCTIONAL_OPS[func._schema.name.split("::")[-1]]
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            self.calls.append((op, sum(nbytes(t) for t in tensors)))
        return func(*args, **(kwargs or {}))
