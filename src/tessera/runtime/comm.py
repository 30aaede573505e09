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
Every tensor handed to a call that moves data must live on the mesh's device (NCCL
rejects CPU tensors; checking here makes a CPU-only test catch it).

With a link model (``Comm.emulate(link)``, see ``runtime.link``) every transfer also
waits until the time it would have taken on that link; the bytes counted stay exact and
the emulated waits are kept apart (``Ledger.emulated``). A synchronous call waits after it
returns. An asynchronous one (isend, irecv, all_gather_async, all_reduce, all_gather_into and
reduce_scatter_into with async_op=True)
completes, when waited for, no earlier than its emulated end, counted from when every
participant had posted it: compute done in between overlaps the transfer, as it would on
the real link. A send carries its emulated end to the receiver in an 8-byte header (not
counted); an asynchronous collective learns the last rank's post time from a small MAX
all-reduce beside it (not counted). Clocks are CLOCK_MONOTONIC, shared by the processes
of one machine: emulation is for single-machine runs. An asynchronous call takes its turn
on the link when it is waited for, from its post time: the link's order is the order of the
waits, which can differ from the order of issue.

A call that fails or does not complete within ``Comm.timeout_s`` (default: the variable
TESSERA_COLLECTIVE_TIMEOUT_S, else the process group's own timeout) raises a
``CollectiveError`` naming this rank, the operation and the mesh axis: a peer that stopped
calling collectives or died ends the job with an error, never a silent wait. (With NCCL a
timeout makes each wait hold the host until the collective ends; without one, a wait only
orders the stream, as torch's synchronous calls do.)
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tessera.runtime.ledger import EmulatedWork, Ledger, LinkClock, _Blocking, _Done, nbytes, now

if TYPE_CHECKING:
    from tessera.runtime.link import Link
    from tessera.runtime.mesh import Mesh


# torch 2.13 renamed the flat collectives; older releases (e.g. on a GPU image) have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


WORLD = "world"
TIMEOUT_ENV = "TESSERA_COLLECTIVE_TIMEOUT_S"


class CollectiveError(RuntimeError):
    """A collective or point-to-point call that failed or did not complete in time."""


def _timeout_from_env() -> float | None:
    value = os.environ.get(TIMEOUT_ENV)
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return seconds


class Comm:
    """Counted collectives over the axes of one Mesh."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.ledger = Ledger()
        self.clock: LinkClock | None = None
        self.timeout_s: float | None = _timeout_from_env()  # None: the process group's timeout

    # ---- completion within the timeout, or an error that names the call ----------------------

    def _finish(self, work, op: str, axis: str) -> None:
        """Wait for ``work``; a failure or timeout becomes a CollectiveError naming the call."""
        try:
            if self.timeout_s is None:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise self._error(op, axis, exc) from exc

    def _error(self, op: str, axis: str, exc: BaseException) -> CollectiveError:
        rank = dist.get_rank() if dist.is_initialized() else 0
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"rank {rank}: {op} over mesh axis {axis!r} ({self._size(axis)} ranks)"
        if "timed out" in text.lower() or "timeout" in text.lower():
            limit = f"{self.timeout_s:g}s" if self.timeout_s is not None else "the process group's timeout"
            return CollectiveError(
                f"{where} did not complete within {limit}: a peer stopped calling collectives or died ({text})"
            )
        return CollectiveError(f"{where} failed: a peer died or left ({text})")

    def _named(self, work, op: str, axis: str):
        """An asynchronous call's work, whose wait names the call when it fails."""
        return _NamedWork(work, lambda w: self._finish(w, op, axis))

    def emulate(self, link: Link | None) -> None:
        """Make every later transfer take at least the time it would on ``link`` (None: off)."""
        self.clock = None if link is None else LinkClock(link)

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        """Every tensor on the mesh's device, also along axes of size 1 (where nothing moves):
        a one-GPU NCCL run then catches what would crash on many GPUs."""
        if not dist.is_initialized():
            return
        device = self.mesh.device
        for t in tensors:
            if t.device != device:
                raise ValueError(
                    f"{op}: a tensor on {t.device} was handed to a collective whose mesh runs on {device}; "
                    f"create it with device=mesh.device (or .to(mesh.device))"
                )

    def _wait_until(self, end: float, op: str, axis: str) -> None:
        delay = end - now()
        if delay > 0:
            time.sleep(delay)
            self.ledger.emulated[(op, axis)] += delay

    def _emulate_sync(self, op: str, axis: str, num_bytes: int) -> None:
        """After a synchronous call: it could not start before the last rank arrived, which
        is about when it returned here."""
        if self.clock is not None:
            self._wait_until(self.clock.end(now(), op, num_bytes, self._size(axis)), op, axis)

    def _emulate_async(self, work, op: str, axis: str, num_bytes: int, device) -> object:
        """An asynchronous collective: ends at the last rank's post time + link time."""
        if self.clock is None:
            return work
        posted = torch.tensor([now()], dtype=torch.float64, device=device)
        stamp = dist.all_reduce(posted, dist.ReduceOp.MAX, group=self._group(axis), async_op=True)
        clock = self.clock

        def finish() -> None:
            stamp.wait()
            self._wait_until(clock.end(posted.item(), op, num_bytes, self._size(axis)), op, axis)

        return EmulatedWork(work, finish)

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
        self._check("all_reduce", t)
        if not self._moves(axis):
            return None
        self.ledger.record("all_reduce", axis, nbytes(t))
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        work = self._named(
            dist.all_reduce(t, reduce_op, group=self._group(axis), async_op=True), "all_reduce", axis
        )
        if async_op:
            assert op != "avg", "avg is only offered synchronously"
            return self._emulate_async(work, "all_reduce", axis, nbytes(t), t.device)
        work.wait()
        self._emulate_sync("all_reduce", axis, nbytes(t))
        if op == "avg":
            t.div_(self._size(axis))
        return None

    def all_gather(self, t: torch.Tensor, axis: str, *, dim: int = 0) -> torch.Tensor:
        """Concatenation along ``dim`` of every rank's ``t`` (equal shapes), in axis order.
        Differentiable: the gradient is reduce-scattered back (each rank's use summed)."""
        if torch.is_grad_enabled() and t.requires_grad and self._moves(axis):
            return _AllGather.apply(t, self, axis, dim)
        return self.all_gather_async(t, axis, dim=dim)()

    def all_gather_async(self, t: torch.Tensor, axis: str, *, dim: int = 0) -> Callable[[], torch.Tensor]:
        """Start an all_gather; the returned function waits for it and gives the result."""
        n = self.mesh.size(axis)
        self._check("all_gather", t)
        if n == 1:
            return lambda: t
        self.ledger.record("all_gather", axis, nbytes(t))
        src = t.movedim(dim, 0).contiguous()
        out = torch.empty((n * src.shape[0], *src.shape[1:]), dtype=t.dtype, device=t.device)
        work = _all_gather_flat(out.view(-1), src.view(-1), group=self.mesh.group(axis), async_op=True)
        work = self._emulate_async(
            self._named(work, "all_gather", axis), "all_gather", axis, nbytes(t), t.device
        )

        def finish() -> torch.Tensor:
            work.wait()
            return out.movedim(0, dim)

        return finish

    def reduce_scatter(self, t: torch.Tensor, axis: str, *, dim: int = 0) -> torch.Tensor:
        """Sum over ranks of ``t``, split into equal chunks along ``dim``; returns my chunk."""
        n = self.mesh.size(axis)
        self._check("reduce_scatter", t)
        if n == 1:
            return t
        if t.shape[dim] % n:
            raise ValueError(
                f"reduce_scatter: dim {dim} of size {t.shape[dim]} is not divisible by {axis}={n}"
            )
        self.ledger.record("reduce_scatter", axis, nbytes(t))
        src = t.movedim(dim, 0).contiguous()
        out = torch.empty((src.shape[0] // n, *src.shape[1:]), dtype=t.dtype, device=t.device)
        work = _reduce_scatter_flat(out.view(-1), src.view(-1), group=self.mesh.group(axis), async_op=True)
        self._finish(work, "reduce_scatter", axis)
        self._emulate_sync("reduce_scatter", axis, nbytes(t))
        return out.movedim(0, dim)

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, axis: str, *, async_op: bool = False):
        """Flat, in place: ``out`` (n x shard elements) becomes every rank's ``shard`` in axis
        order. ``async_op``: returns a work object to ``wait`` on (keep both tensors alive and
        unchanged until then)."""
        self._check("all_gather", out, shard)
        if self.mesh.size(axis) == 1:
            out.view(-1).copy_(shard.view(-1))
            return _Done() if async_op else None
        self.ledger.record("all_gather", axis, nbytes(shard))
        began = now()
        work = _all_gather_flat(
            out.view(-1), shard.contiguous().view(-1), group=self.mesh.group(axis), async_op=True
        )
        return self._flat(work, "all_gather", axis, nbytes(shard), out.device, async_op, began)

    def reduce_scatter_into(
        self, out: torch.Tensor, full: torch.Tensor, axis: str, *, async_op: bool = False
    ):
        """Flat, in place: ``out`` becomes my 1/n of the sum over ranks of ``full``.
        ``async_op``: returns a work object to ``wait`` on (keep both tensors alive until then)."""
        self._check("reduce_scatter", out, full)
        if self.mesh.size(axis) == 1:
            out.view(-1).copy_(full.view(-1))
            return _Done() if async_op else None
        self.ledger.record("reduce_scatter", axis, nbytes(full))
        began = now()
        work = _reduce_scatter_flat(
            out.view(-1), full.contiguous().view(-1), group=self.mesh.group(axis), async_op=True
        )
        return self._flat(work, "reduce_scatter", axis, nbytes(full), out.device, async_op, began)

    def _flat(self, work, op: str, axis: str, num_bytes: int, device, async_op: bool, began: float):
        """Wait for a flat call now, or hand back its work; either way count its link time and
        the time it blocks the caller (``Ledger.hidden``)."""
        if self.clock is not None:
            self.ledger.link_s[(op, axis)] += self.clock.link.seconds(op, num_bytes, self._size(axis))
        if async_op:
            named = self._emulate_async(self._named(work, op, axis), op, axis, num_bytes, device)
            return _Blocking(named, self.ledger, (op, axis))
        self._finish(work, op, axis)
        self._emulate_sync(op, axis, num_bytes)
        self.ledger.blocked_s[(op, axis)] += now() - began
        return None

    def all_to_all(self, t: torch.Tensor, axis: str, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Split ``t`` into equal chunks along ``scatter_dim``, send chunk i to rank i, and
        concatenate what arrives along ``gather_dim``. Differentiable: the gradient takes the
        inverse all-to-all."""
        if torch.is_grad_enabled() and t.requires_grad and self._moves(axis):
            return _AllToAll.apply(t, self, axis, scatter_dim, gather_dim)
        return self._all_to_all(t, axis, scatter_dim=scatter_dim, gather_dim=gather_dim)

    def _all_to_all(self, t: torch.Tensor, axis: str, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        self._check("all_to_all", t)
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
        self._finish(
            dist.all_to_all_single(out, src, group=self.mesh.group(axis), async_op=True), "all_to_all", axis
        )
        self._emulate_sync("all_to_all", axis, nbytes(t))
        # out[i] holds rank i's chunk; put rank order along gather_dim.
        chunks = out.chunk(n, dim=0)
        return torch.cat([c.movedim(0, scatter_dim) for c in chunks], dim=gather_dim)

    def all_to_all_split(
        self, t: torch.Tensor, axis: str, send_sizes: list[int], recv_sizes: list[int]
    ) -> torch.Tensor:
        """Rows ``send_sizes[i]`` of ``t`` (dim 0, in order) to rank i; returns the rows that
        arrive, ``recv_sizes[i]`` from rank i, in rank order (any size, zero too).
        Differentiable: the gradient goes back by the inverse exchange."""
        if torch.is_grad_enabled() and t.requires_grad and self._moves(axis):
            return _AllToAllSplit.apply(t, self, axis, tuple(send_sizes), tuple(recv_sizes))
        return self._all_to_all_split(t, axis, send_sizes, recv_sizes)

    def _all_to_all_split(self, t, axis: str, send_sizes, recv_sizes) -> torch.Tensor:
        self._check("all_to_all", t)
        n = self._size(axis)
        assert len(send_sizes) == len(recv_sizes) == n, (send_sizes, recv_sizes)
        assert sum(send_sizes) == t.shape[0], (send_sizes, t.shape)
        if n == 1:
            return t
        self.ledger.record("all_to_all", axis, nbytes(t))
        src = t.contiguous()
        out = src.new_empty((sum(recv_sizes), *src.shape[1:]))
        work = dist.all_to_all_single(
            out, src, list(recv_sizes), list(send_sizes), group=self._group(axis), async_op=True
        )
        self._finish(work, "all_to_all", axis)
        self._emulate_sync("all_to_all", axis, nbytes(t))
        return out

    def broadcast(self, t: torch.Tensor, axis: str, *, src: int = 0) -> torch.Tensor:
        """In place from the rank at coordinate ``src`` along ``axis``."""
        self._check("broadcast", t)
        if not self._moves(axis):
            return t
        self.ledger.record("broadcast", axis, nbytes(t))
        root = src if axis == WORLD else self.mesh.global_rank_of(axis, src)
        self._finish(dist.broadcast(t, root, group=self._group(axis), async_op=True), "broadcast", axis)
        self._emulate_sync("broadcast", axis, nbytes(t))
        return t

    def isend(self, t: torch.Tensor, axis: str, *, dst: int):
        """Returns a work object to ``wait`` on; keep ``t`` alive and unchanged until then."""
        assert t.is_contiguous(), "send buffers must be contiguous (and kept alive until wait)"
        self._check("isend", t)
        self.ledger.record("send", axis, nbytes(t))
        peer, group = self.mesh.global_rank_of(axis, dst), self.mesh.group(axis)
        if self.clock is None:
            return self._named(dist.isend(t, peer, group=group), "send", axis)
        end = self.clock.end(now(), "send", nbytes(t), 2)
        packed = torch.empty(8 + nbytes(t), dtype=torch.uint8, device=t.device)
        packed[:8].copy_(torch.tensor([end], dtype=torch.float64).view(torch.uint8))  # header: the end
        packed[8:].copy_(t.view(-1).view(torch.uint8))
        work = self._named(dist.isend(packed, peer, group=group), "send", axis)
        return EmulatedWork(work, lambda: self._wait_until(end, "send", axis), keep=packed)

    def irecv(self, t: torch.Tensor, axis: str, *, src: int):
        """Returns a work object; ``t`` holds the data once ``wait`` returned."""
        assert t.is_contiguous(), "receive buffers must be contiguous"
        self._check("irecv", t)
        self.ledger.record("recv", axis, nbytes(t))
        peer, group = self.mesh.global_rank_of(axis, src), self.mesh.group(axis)
        if self.clock is None:
            return self._named(dist.irecv(t, peer, group=group), "recv", axis)
        packed = torch.empty(8 + nbytes(t), dtype=torch.uint8, device=t.device)
        work = self._named(dist.irecv(packed, peer, group=group), "recv", axis)

        def finish() -> None:
            t.view(-1).view(torch.uint8).copy_(packed[8:])
            self._wait_until(packed[:8].view(torch.float64).item(), "recv", axis)

        return EmulatedWork(work, finish)

    def barrier(self, axis: str | None = None) -> None:
        if axis is None:
            if dist.is_initialized():
                self._finish(dist.barrier(async_op=True), "barrier", WORLD)
        elif self._moves(axis):
            self._finish(dist.barrier(group=self.mesh.group(axis), async_op=True), "barrier", axis)


class _NamedWork:
    """A torch work object whose ``wait`` names the call when it fails or times out."""

    def __init__(self, work, finish: Callable):
        self.work, self._finish = work, finish

    def wait(self, *args, **kwargs) -> bool:
        self._finish(self.work)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


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


class _AllToAllSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm: Comm, axis: str, send_sizes: tuple, recv_sizes: tuple):
        ctx.comm, ctx.axis, ctx.sizes = comm, axis, (send_sizes, recv_sizes)
        return comm._all_to_all_split(t, axis, send_sizes, recv_sizes)

    @staticmethod
    def backward(ctx, grad):
        send_sizes, recv_sizes = ctx.sizes
        out = ctx.comm._all_to_all_split(grad.contiguous(), ctx.axis, recv_sizes, send_sizes)
        return out, None, None, None, None
