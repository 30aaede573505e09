"""Data parallelism and ZeRO 1/2/3 as settings of one core: parameters grouped into flat
chunks (``tessera.memory.chunk_manager``), each chunk split into equal shards over the
``dp`` axis. This module is the sharding: who owns which range, and the collectives.

One chunk is the unit of every collective: after backward, a chunk's gradients are copied
into one flat buffer as soon as the last of its parameters has its gradient, and reduced in
one call. What the stage changes:

========  =============================  ==========================  =====================
stage     gradients after backward       optimizer state             parameters at rest
========  =============================  ==========================  =====================
0         all-reduced, left in p.grad    user's optimizer, full      full
1         all-reduced, left in p.grad    this rank's shard only      full (all-gathered)
2         reduce-scattered, p.grad freed this rank's shard only      full (all-gathered)
3         reduce-scattered, p.grad freed this rank's shard only      this rank's shard only
========  =============================  ==========================  =====================

At stages 1-3 the optimizer runs on one flat fp32 shard per chunk (a Parameter whose
``.grad`` is that shard of the averaged gradient), so its states are 1/dp of the model's.
At stages 1-2 the chunk buffer is the parameters' storage and the shard a view of its
range, so stepping the shard updates those parameters in place and one all-gather of the
shards completes the rest (no second copy of the parameters).
It is the user's own optimizer object, its groups' parameters swapped for the shards of
their chunks: class, constructor settings and hooks stay; its update must be elementwise
(``tessera.boost`` checks).
Stage 3 keeps only that shard between uses: a chunk's parameters are views of one full
buffer whose storage is emptied after use and refilled by an all-gather before a module's
forward, and again before its backward (autograd's saved views see the refilled storage).
As with FSDP, every rank must then run the same modules in the same order. At stages 0-2
ranks may use different parameters in a step: chunks are reduced in one fixed order, and a
parameter any rank used gets the averaged gradient on every rank.

``prefetch`` (``Plan.prefetch``, default 1) overlaps the collectives with compute: stage 3
all-gathers the next chunks in the learned use order while a module computes (forward and
backward), and stages 2-3 leave gradient reduce-scatters in flight until ``finish_backward``,
at most ``prefetch`` chunks each way (``tessera.parallel.zero_overlap``, which also says
what stays synchronous); 0 waits for every collective where it is issued. Bit-exact either way.

Tensor parallel parameters (DTensors) take part through their local shards (at stage 3 the local
shard itself is bound to the chunk buffer); a chunk holds
parameters of one optimizer group and one kind (sharded over ``tp`` or replicated on it), so
the global gradient norm counts each replicated element once.

Expert parameters of an expert parallel plan (``tessera.parallel.experts``, DTensors sharded
over ``ep``) live in chunks of their own, averaged and sharded over the ``edp`` axis of the
expert mesh: the dp / ep ranks that hold the same experts (of one tp coordinate). With tp each
tp rank dispatches its slice of the batch its tp group shares, so an expert's local gradient
is a partial sum over tp: it is all-reduced over tp first, then reduced over edp. Every chunk's summed gradient is
divided by dp: with the loss a mean over the global batch, a dense parameter's gradient is
the average of dp local ones, and an expert's local gradient already sums the
contributions of the tokens of all ep ranks of its group (the all-to-all brought them), so
the sum over edp of those, over dp, is its gradient. The global norm counts each expert once
(summed over ``ep``).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from tessera.memory.chunk import ChunkState
from tessera.memory.chunk_manager import ChunkManager, ParamChunk
from tessera.memory.chunk_manager import local as _local
from tessera.memory.materialize import materialized
from tessera.memory.offload import ShardOffload, check_offload
from tessera.parallel.zero_overlap import InFlight, install_stage3_hooks
from tessera.parallel.zero_placement import InMemory, Offloaded
from tessera.runtime import Mesh
from tessera.runtime.comm import Comm


@dataclass(frozen=True)
class Stage:
    """What a ZeRO stage shards over the dp axis (the table in the module doc, as data): the
    engine reads these names, not the stage's number."""

    states: bool  # 1-3: the optimizer steps this rank's flat shard of every chunk
    gradients: bool  # 2-3: gradients reduce-scattered to shards (0-1: all-reduced, left in p.grad)
    parameters: bool  # 3: a chunk's storage freed between uses, all-gathered before each

    @property
    def gathers_updates(self) -> bool:
        """1-2: the chunk is the parameters' storage; after a step the other ranks' updated
        shards are all-gathered into it."""
        return self.states and not self.parameters


STAGES = {
    0: Stage(states=False, gradients=False, parameters=False),
    1: Stage(states=True, gradients=False, parameters=False),
    2: Stage(states=True, gradients=True, parameters=False),
    3: Stage(states=True, gradients=True, parameters=True),
}


@dataclass(frozen=True)
class Span:
    """The ranks a chunk is averaged and sharded over: ``size`` ranks along ``axis`` of the
    mesh ``comm`` talks over, this rank at coordinate ``rank``."""

    comm: Comm
    axis: str
    size: int
    rank: int
    partial: str | None = None  # an axis over which the local gradients are partial sums


class ZeroEngine:
    """Installs the gradient hooks (and stage 3's gather/release hooks) on ``model`` and
    provides the optimizer step. Built by ``tessera.boost``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        zero: int,
        mesh: Mesh,
        axis: str = "dp",
        chunk_elems: int = 8 << 20,
        max_grad_norm: float | None = None,
        tp_axis: str | None = None,
        segment_of: dict[nn.Parameter, int] | None = None,
        offload: dict | None = None,
        expert_mesh: Mesh | None = None,
        expert_params: set[nn.Parameter] | None = None,
        prefetch: int = 1,
        init=None,
    ):
        self.model, self.zero, self.mesh, self.axis = model, zero, mesh, axis
        self.stage = stage = STAGES[zero]
        self.tp_axis = tp_axis if tp_axis is not None and mesh.size(tp_axis) > 1 else None
        self.max_grad_norm = max_grad_norm
        self.comm = mesh.comm
        self.sync = True
        self.recomputing = False  # inside activation checkpointing's recomputation
        self.inflight = InFlight(prefetch)  # collectives not yet waited for (zero_overlap)
        dp = mesh.size(axis)
        self.dp, self.rank = dp, mesh.rank(axis)
        dense = Span(self.comm, axis, dp, self.rank)
        experts = dense if expert_mesh is None else _expert_span(expert_mesh)
        self.manager = ChunkManager(
            optimizer.param_groups,
            chunk_elems=chunk_elems,
            align=dp,
            segment_of=segment_of,
            expert=expert_params,
            expert_align=experts.size,
            lazy=stage.states,  # each chunk made real below, one at a time (memory.materialize)
            device=mesh.device,
        )
        self.groups: list[ParamChunk] = self.manager.chunks
        self.span = {cg: experts if cg.expert else dense for cg in self.groups}
        if offload is not None:  # refused before any chunk is bound or freed: the model stays whole
            assert zero == 3, "offload moves ZeRO-3 chunks (Plan checks)"
            check_offload(
                self.manager,
                optimizer,
                dp=dp,
                device=mesh.device,
                rank=self.rank,
                prefetch=prefetch,
                **offload,
            )
        self.owner = self.manager.owner
        self.pending = {cg: len(cg.params) for cg in self.groups}
        self.expected = dict(self.pending)  # gradients a step brings (fewer: unused modules)
        self.reduced = {cg: False for cg in self.groups}
        self.grad_shard: dict[ParamChunk, torch.Tensor | None] = {}
        self.seen: set[nn.Parameter] = set()
        self.shards: list[nn.Parameter] = []
        if stage.states:
            shard_of = {}
            # the chunk becomes the parameters' storage (stage 1-2: the shard a view of it;
            # 3: a copy, the chunk freed before the next is made)
            for cg in materialized(self.manager, model, init):
                span = self.span[cg]
                if init is not None:  # initialised on every rank: dp-rank 0's values everywhere
                    span.comm.broadcast(cg.chunk.buffer, span.axis, src=0)
                piece = cg.chunk.shard(span.rank, span.size)
                shard_of[cg] = nn.Parameter(piece.clone() if stage.parameters else piece)
                if stage.parameters:
                    cg.free()
            self.shards = [shard_of[cg] for cg in self.groups]
            for gi, group in enumerate(optimizer.param_groups):
                group["params"] = [
                    s for s, cg in zip(self.shards, self.groups, strict=True) if cg.group_index == gi
                ]
                group.pop("param_names", None)  # they named the parameters, not the shards
            optimizer.state.clear()  # any state it held is loaded again by tessera.boost
        self.optimizer = optimizer
        self.offload = None  # tessera.memory.offload.ShardOffload, when chunks are tiered
        self.placement = InMemory(self)  # where chunks are kept (zero_placement): Offloaded when tiered
        if stage.parameters:
            if offload is not None:
                self._start_offload(offload)
            install_stage3_hooks(self)
        elif not stage.states:
            for cg in self.groups:
                cg.free()  # the packed copy is not needed: parameters keep their own storage
        # the hook holds the engine weakly: a tensor's hooks live on autograd's C++ side,
        # where the garbage collector cannot see the parameter -> engine -> model -> parameter
        # cycle, so a bound method there kept every boosted model (and its device memory)
        # alive after its last user reference was gone
        ready = weakref.WeakMethod(self._grad_ready)

        def hook(p: nn.Parameter) -> None:
            method = ready()
            if method is not None:  # a parameter that outlived its engine reduces nothing
                method(p)

        for p in self.owner:
            p.register_post_accumulate_grad_hook(hook)

    # ---- gradients -------------------------------------------------------------------------
    def no_sync(self):
        """Backward passes inside accumulate gradients locally (earlier micro-batches);
        offloaded, each is reduced into the gradient chunks (whole ones would not fit)."""
        return self.placement.no_sync()

    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        if p in self.seen:
            return  # a gradient landing twice in one backward (a shared parameter) counts once
        self.seen.add(p)
        self.pending[self.owner[p]] -= 1
        self._reduce_ready()

    def _reduce_ready(self) -> None:
        """Reduce chunks in one fixed order on every rank (last chunk first, as backward
        finishes them): a chunk whose gradients are complete early waits for the ones before
        it, so ranks whose steps used different parameters still pair their collectives."""
        for cg in reversed(self.groups):
            if self.reduced[cg]:
                continue
            if self.pending[cg] > 0:
                return
            self._reduce(cg)

    def shard_bounds(self, cg: ParamChunk) -> tuple[int, int]:
        """The flat range of ``cg`` this rank owns."""
        span = self.span[cg]
        size = cg.chunk.capacity // span.size
        return span.rank * size, (span.rank + 1) * size

    def _reduce(self, cg: ParamChunk) -> None:
        flat = cg.flat_grads()
        lo, hi = self.shard_bounds(cg)
        span = self.span[cg]
        if span.partial is not None:  # experts under tp: each tp rank ran its slice of the tokens
            span.comm.all_reduce(flat, span.partial)
        if not self.stage.gradients:
            # which parameters got a gradient on any rank: those get the average everywhere
            # (a rank that did not use one gets it too); the others stay None (skipped)
            had = torch.tensor([float(p.grad is not None) for p in cg.params], device=self.mesh.device)
            span.comm.all_reduce(had, span.axis, op="max")
            span.comm.all_reduce(flat, span.axis)
            flat.div_(self.dp)  # over dp, expert chunks too (see the module doc)
            cg.write_grads(flat, [bool(h) for h in had])
            self.grad_shard[cg] = flat[lo:hi].clone()
        else:
            self.placement.reduce_scatter(cg, flat)
            for p in cg.params:
                p.grad = None
            if self.stage.parameters:
                self._release(cg)
        self.reduced[cg] = True

    def gather(
        self,
        cg: ParamChunk,
        shard: torch.Tensor,
        after: ChunkState = ChunkState.HOLD_AFTER_FWD,
        *,
        wait: bool = True,
    ) -> None:
        """Stage 3: refill ``cg``'s buffer from every rank's shard (autograd's saved views stay
        valid: their version counter is kept). Offloaded: the shard is fetched, left ``after``.
        ``wait=False``: the all-gather is left in flight (a prefetch), finished by the next
        ``gather`` or ``_release`` of the chunk."""
        if cg.resident:
            if wait:
                self.inflight.finish_gather(cg)  # a prefetched chunk: its all-gather done
            return
        self.placement.reserve(cg)
        buffer = cg.restore()
        self.manager.transition(cg, ChunkState.COMPUTE)
        # the version counter as it is now, set back once the data has landed: gloo may write
        # an asynchronous result into ``buffer`` (an in-place copy) on its own thread, later
        keep = torch.autograd._unsafe_preserve_version_counter(buffer)
        with torch.no_grad(), keep:  # offloaded: from the master shards or, at bf16, their copies
            finish = self.placement.gather(cg, buffer, shard, after, wait=wait)
        if not wait:

            def done():
                with torch.no_grad(), keep:
                    finish()

            self.inflight.add_gather(cg, done)

    def _release(self, cg: ParamChunk) -> None:  # stage 3: a whole chunk after its last use
        if not cg.resident:
            return
        self.inflight.finish_gather(cg)  # a prefetched chunk's all-gather lands first
        cg.free()
        self.manager.transition(cg, ChunkState.RELEASED)
        self.placement.release(cg)

    def finish_backward(self) -> None:
        """Reduce chunks some of whose parameters got no gradient this step (unused ones),
        then wait for the reduce-scatters in flight."""
        for cg in self.groups:
            self.pending[cg] = 0
        self._reduce_ready()
        self.inflight.finish_reduces()

    # ---- optimizer (the in-memory step: zero_placement.InMemory) ---------------------------
    def step(self, loss_scaler=None) -> tuple[float | None, bool]:
        """Reduce what is left, then (if ``loss_scaler``, a ``tessera.train.loss_scale.
        LossScaler``) unscale and agree on overflow, clip, and step unless skipped.
        Returns (gradient norm if clipping, whether the step was skipped)."""
        self.finish_backward()
        return self.placement.step(loss_scaler)

    def new_round(self) -> None:
        for cg in self.groups:
            self.pending[cg], self.reduced[cg] = self.expected[cg], False
        self.seen.clear()

    def _start_offload(self, settings: dict) -> None:
        whole = [cg.chunk.buffer for cg in self.groups]
        device, rank = self.mesh.device, self.mesh.rank(self.axis)
        self.offload = ShardOffload.create(
            self.manager, self.optimizer, self.shards, whole, device=device, rank=rank,
            prefetch=self.inflight.prefetch, **settings,
        )  # fmt: skip
        self.placement = Offloaded(self, self.offload)

    def resident(self):
        """Offloaded: every chunk in fast memory meanwhile (checkpoint save and load)."""
        return self.placement.resident()

    def gather_shards(self, cg: ParamChunk, out: torch.Tensor, shard: torch.Tensor) -> None:
        """``out`` (the chunk's capacity) becomes every owner's ``shard`` of ``cg``, in order."""
        self.span[cg].comm.all_gather_into(out, shard, self.span[cg].axis)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.owner:
            p.grad = None

    # ---- loading (tessera.train.sharded_checkpoint) -----------------------------------------
    def load_local(self, p: nn.Parameter, kind: str, local: torch.Tensor, scalars: dict) -> None:
        """Set this rank's piece of parameter ``p`` (``kind`` "param") or of one of its
        per-element optimizer states from ``local`` (p's whole local tensor)."""
        cg = self.owner[p]
        slot = cg.slot_of(p)
        with torch.no_grad():
            if kind == "param" and not self.stage.parameters:
                _local(p.data).copy_(local)
            if not self.stage.states:
                if kind != "param":
                    value = local.clone()
                    if hasattr(p, "placements"):
                        from torch.distributed.tensor import DTensor

                        value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False)
                    state = self.optimizer.state[p]
                    state[kind] = value
                    state.update({k: _scalar(v) for k, v in scalars.items()})
                return
            shard = self.shards[self.groups.index(cg)]
            lo, hi = self.shard_bounds(cg)
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a >= b:
                return
            piece = local.reshape(-1)[a - slot.offset : b - slot.offset]
            if kind == "param":
                shard.data[a - lo : b - lo] = piece
            else:
                state = self.optimizer.state[shard]
                if kind not in state:
                    state[kind] = torch.zeros_like(shard.data)
                state[kind][a - lo : b - lo] = piece
                state.update({k: _scalar(v) for k, v in scalars.items()})

    # ---- stage 3 ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def recomputation(self):
        """The context activation checkpointing recomputes a block in (see zero_overlap's post_forward)."""
        self.recomputing = True
        try:
            yield
        finally:
            self.recomputing = False

    def gather_all(self) -> None:
        """Stage 3: every parameter whole (evaluation, saving); offloaded, past the budget
        until the next forward empties them (``start_of_forward``)."""
        with self.placement.unbounded():
            for cg, shard in zip(self.groups, self.shards, strict=True):
                self.gather(cg, shard.detach())


def _expert_span(expert_mesh: Mesh) -> Span:
    """Expert chunks: over the ``edp`` ranks of the expert mesh (those holding the same
    experts), their gradients first summed over ``tp`` (each tp rank dispatches its slice of
    the batch its tp group shares)."""
    tp = "tp" if expert_mesh.size("tp") > 1 else None
    return Span(expert_mesh.comm, "edp", expert_mesh.size("edp"), expert_mesh.rank("edp"), partial=tp)


def _scalar(value) -> torch.Tensor:
    return value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)


def chunk_elems_for(mib: float) -> int:
    return max(1, math.ceil(mib * 2**20 / 4))
