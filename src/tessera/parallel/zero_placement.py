"""Where a ZeRO rank keeps its chunks, as ``ZeroEngine`` asks it: in memory (``InMemory``)
or tiered between the compute tier, host memory and disk by
``tessera.memory.offload.ShardOffload`` (``Offloaded``, ZeRO-3 only). The stage table
(``zero.STAGES``) says what a rank shards; this says where it keeps it. The engine calls
the same methods either way:

==============  ===========================================  ==============================================
method          InMemory                                     Offloaded
==============  ===========================================  ==============================================
reserve         -                                            room for the whole chunk on the compute tier
gather          all-gather from the rank's shard             all-gather from the master shard (or its bf16
                                                             copy), fetched where it is
release         -                                            the whole chunk's room back
reduce_scatter  into a gradient shard in memory, left in     into the store's gradient chunk at once (a
                flight (``prefetch``)                        second micro-batch adds to it)
no_sync         micro-batches accumulate in ``p.grad``       each micro-batch reduced into the gradient
                                                             chunks (whole gradients would not fit)
step            unscale, clip, the user's optimizer on       clip and step chunk by chunk where the store
                every shard                                  brings each
resident /      -                                            every chunk in fast memory / the budget
unbounded                                                    suspended (checkpoints, ``gather_all``)
==============  ===========================================  ==============================================
"""

from __future__ import annotations

import contextlib

import torch

from tessera.memory.chunk import ChunkState
from tessera.memory.chunk_manager import ParamChunk
from tessera.memory.chunk_manager import local as _local
from tessera.memory.clip import clip_coefficient


class InMemory:
    def __init__(self, engine):
        self.engine = engine

    def reserve(self, cg: ParamChunk) -> None:
        pass

    def gather(self, cg: ParamChunk, buffer: torch.Tensor, shard: torch.Tensor, after: ChunkState, *, wait):
        span = self.engine.span[cg]
        work = span.comm.all_gather_into(buffer, shard, span.axis, async_op=not wait)
        return None if wait else work.wait

    def release(self, cg: ParamChunk) -> None:
        pass

    def reduce_scatter(self, cg: ParamChunk, flat: torch.Tensor) -> None:
        engine, span = self.engine, self.engine.span[cg]
        lo, hi = engine.shard_bounds(cg)
        shard = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
        engine.grad_shard[cg] = shard  # averaged once the reduce-scatter is waited for
        if engine.inflight.prefetch:  # flat stays alive in the closure until the wait
            work = span.comm.reduce_scatter_into(shard, flat, span.axis, async_op=True)
            engine.inflight.add_reduce(work, lambda shard=shard, flat=flat: shard.div_(engine.dp))
        else:
            span.comm.reduce_scatter_into(shard, flat, span.axis)
            shard.div_(engine.dp)

    @contextlib.contextmanager
    def no_sync(self):
        self.engine.sync = False
        try:
            yield
        finally:
            self.engine.sync = True

    def step(self, loss_scaler) -> tuple[float | None, bool]:
        engine = self.engine
        found_inf = None
        if loss_scaler is not None:
            found_inf = loss_scaler.unscale_(self.reduced_grads())
            engine.comm.all_reduce(found_inf, engine.axis, op="max")  # shards differ over dp
            if engine.tp_axis is not None:
                engine.comm.all_reduce(found_inf, engine.tp_axis, op="max")
        skipped = found_inf is not None and bool(found_inf.item() > 0)
        norm = None
        if not skipped:
            norm = self.clip()
            self.optimizer_step()
        engine.new_round()
        engine.grad_shard.clear()
        if loss_scaler is not None:
            loss_scaler.update(found_inf)
        return norm, skipped

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm over every parameter once (after reduction)."""
        e = self.engine
        total = self._squares([cg for cg in e.groups if not cg.expert])
        if e.stage.states:  # each rank holds its shard of the reduced gradients
            e.comm.all_reduce(total, e.axis)
        if e.tp_axis is not None:
            e.comm.all_reduce(total, e.tp_axis)
        experts = [cg for cg in e.groups if cg.expert]
        if experts:  # each rank holds its ep share of the experts, ZeRO-sharded over edp
            part, span = self._squares(experts), e.span[experts[0]]
            if e.stage.states:
                span.comm.all_reduce(part, span.axis)
            span.comm.all_reduce(part, "ep")
            total += part
        return total.sqrt()

    def _squares(self, chunks: list[ParamChunk]) -> torch.Tensor:
        """This rank's sum of squared reduced gradients of ``chunks``."""
        e = self.engine
        total = torch.zeros((), dtype=torch.float64, device=e.mesh.device)
        for cg in chunks:
            if not e.stage.states:
                part = sum(
                    (_local(p.grad).double().pow(2).sum() for p in cg.params if p.grad is not None),
                    torch.zeros((), dtype=torch.float64, device=e.mesh.device),
                )
            else:
                part = e.grad_shard[cg].double().pow(2).sum()
            if e.tp_axis is not None and not cg.tp_sharded and not cg.expert:
                # every tp rank holds the same copy (experts: summed over edp and ep only, which
                # span one tp coordinate, after their reduction over tp; see grad_norm)
                part = part / e.mesh.size(e.tp_axis)
            total += part
        return total

    def reduced_grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer will step with (after reduction): p.grad at stage 0,
        this rank's shards at 1-3 (local tensors: in-place changes reach the DTensors)."""
        e = self.engine
        if not e.stage.states:
            return [_local(p.grad) for p in e.owner if p.grad is not None]
        return [e.grad_shard[cg] for cg in e.groups]

    def clip(self) -> float | None:
        e = self.engine
        if e.max_grad_norm is None:
            return None
        norm = float(self.grad_norm())
        scale = clip_coefficient(norm, e.max_grad_norm)
        if scale is not None:
            for g in self.reduced_grads():
                g.mul_(scale)
        return norm

    def optimizer_step(self) -> None:
        e = self.engine
        if e.stage.states:
            for cg, shard in zip(e.groups, e.shards, strict=True):
                shard.grad = e.grad_shard[cg]
        e.optimizer.step()
        if e.stage.gathers_updates:  # the stepped shard is already in place; gather the others'
            for cg, shard in zip(e.groups, e.shards, strict=True):
                e.gather_shards(cg, cg.chunk.buffer, shard.detach().clone())

    def resident(self):
        return contextlib.nullcontext()

    def unbounded(self):
        return contextlib.nullcontext()


class Offloaded:
    def __init__(self, engine, offload):
        self.engine, self.offload = engine, offload

    def _index(self, cg: ParamChunk) -> int:
        return self.engine.groups.index(cg)

    def reserve(self, cg: ParamChunk) -> None:
        self.offload.reserve(self._index(cg))

    def gather(self, cg: ParamChunk, buffer: torch.Tensor, shard: torch.Tensor, after: ChunkState, *, wait):
        engine = self.engine
        return self.offload.gather_into(
            buffer, self._index(cg), after, engine.comm, engine.axis, async_op=not wait
        )

    def release(self, cg: ParamChunk) -> None:
        self.offload.release(self._index(cg))

    def reduce_scatter(self, cg: ParamChunk, flat: torch.Tensor) -> None:
        engine = self.engine

        def reduce(out):
            engine.comm.reduce_scatter_into(out, flat, engine.axis)
            out.div_(engine.dp)

        self.offload.reduced_into(self._index(cg), reduce)

    @contextlib.contextmanager
    def no_sync(self):
        yield
        self.engine.finish_backward()
        self.engine.new_round()

    def step(self, loss_scaler) -> tuple[float | None, bool]:
        engine = self.engine  # (Plan refuses fp16 loss scaling with offload)
        try:
            return self.offload.step(
                engine.comm, engine.axis, engine.max_grad_norm, engine.mesh.device
            ), False
        finally:
            engine.new_round()

    def resident(self):
        return self.offload.resident()

    def unbounded(self):
        return self.offload.store.unbounded()
