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
            found_inf = loss_scaler.unscale_(engine.reduced_grads())
            engine.comm.all_reduce(found_inf, engine.axis, op="max")  # shards differ over dp
            if engine.tp_axis is not None:
                engine.comm.all_reduce(found_inf, engine.tp_axis, op="max")
        skipped = found_inf is not None and bool(found_inf.item() > 0)
        norm = None
        if not skipped:
            norm = engine.clip()
            engine.optimizer_step()
        engine.new_round()
        engine.grad_shard.clear()
        if loss_scaler is not None:
            loss_scaler.update(found_inf)
        return norm, skipped

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
