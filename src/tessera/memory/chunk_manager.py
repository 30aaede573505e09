"""Parameters living in chunks: which chunk holds which parameter, and the chunk's storage.

``ChunkManager`` packs a model's trainable parameters into flat chunks (``chunk.py``), one
optimizer group and one kind (tensor-parallel-sharded, replicated, or expert parameters of
an expert parallel plan, which ZeRO shards over other ranks) per chunk, in the optimizer's
order. Each ``ParamChunk`` knows its parameters' slots and can:

- copy their gradients into one flat buffer, and a flat buffer back into their gradients;
- ``bind`` the parameters to views of the chunk buffer, so the chunk is their storage;
- ``materialize``: a chunk packed ``lazy`` (its layout only, no storage) gets its storage,
  its parameters' values and becomes their storage, one chunk at a time (so a model is never
  held twice; a parameter without data, from a model built on the meta device, is left zero
  for ``tessera.memory.materialize`` to initialise);
- ``free`` that storage (size 0, views kept) and ``restore`` it for refilling.

Nothing here communicates or decides who owns what: sharding over ranks is
``tessera.parallel.zero``'s job; moving chunks between memory tiers builds on ``free`` /
``restore``.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.memory.chunk import TRANSITIONS, Chunk, ChunkState, Slot, pack


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a DTensor's local shard."""
    return t.to_local() if hasattr(t, "to_local") else t


def tp_sharded(p: torch.Tensor) -> bool:
    return any(pl.is_shard() for pl in getattr(p, "placements", ()))


class ParamChunk:
    def __init__(
        self,
        chunk: Chunk,
        params: list[nn.Parameter],
        group_index: int,
        tp_sharded: bool,
        expert: bool = False,
    ):
        self.chunk, self.params, self.group_index, self.tp_sharded = chunk, params, group_index, tp_sharded
        self.expert = expert  # expert parameters (tessera.parallel.experts): their own ranks
        self.device = chunk.buffer.device  # where the storage lives (a lazy chunk: once materialized)
        self.resident = True
        self.state = ChunkState.FREE  # stage 3 moves it (ZeroEngine.gather / _release)

    def slot_of(self, p: nn.Parameter) -> Slot:
        return self.chunk.slots[next(i for i, q in enumerate(self.params) if q is p)]

    def flat_grads(self) -> torch.Tensor:
        """Every parameter's gradient in its slot (zeros where a parameter got none), fp32."""
        flat = torch.zeros(self.chunk.capacity, dtype=torch.float32, device=self.chunk.buffer.device)
        for slot, p in zip(self.chunk.slots, self.params, strict=True):
            if p.grad is not None and hasattr(p, "placements") and p.grad.placements != p.placements:
                # a tied parameter used by differently sharded modules can get its gradient
                # in another layout: bring it to the parameter's own
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            if p.grad is not None:
                flat[slot.offset : slot.offset + slot.numel].copy_(local(p.grad).reshape(-1))
        return flat

    def write_grads(self, flat: torch.Tensor, present: list[bool]) -> None:
        """Gradients from ``flat``; a parameter without one gets one where ``present`` says so."""
        for slot, p, has in zip(self.chunk.slots, self.params, present, strict=True):
            piece = flat[slot.offset : slot.offset + slot.numel]
            if p.grad is not None:
                local(p.grad).copy_(piece.view_as(local(p.grad)))
            elif has:
                grad = piece.view_as(local(p.data)).to(p.dtype).clone()
                if hasattr(p, "placements"):
                    from torch.distributed.tensor import DTensor

                    grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False)
                p.grad = grad

    def bind(self) -> None:
        """Make the chunk buffer the parameters' storage (a DTensor's local shard, for
        tensor parallel parameters: ``.data`` assignment would copy it instead)."""
        for slot, p in zip(self.chunk.slots, self.params, strict=True):
            if hasattr(p, "_local_tensor"):
                p._local_tensor = self.chunk.view(slot)
            else:
                p.data = self.chunk.view(slot)

    def materialize(self) -> None:
        """A lazily packed chunk's storage on ``device``, each parameter's values copied in
        (one without data, whose storage is empty, left zero), the parameters bound to it."""
        buffer = torch.zeros(self.chunk.capacity, dtype=self.chunk.dtype, device=self.device)
        for slot, p in zip(self.chunk.slots, self.params, strict=True):
            data = local(p.detach())
            if data.untyped_storage().nbytes():
                buffer[slot.offset : slot.offset + slot.numel].copy_(data.reshape(-1))
        self.chunk.buffer = buffer
        self.resident = True
        self.bind()

    def free(self) -> None:
        if self.resident:
            self.chunk.buffer.untyped_storage().resize_(0)
            self.resident = False

    def restore(self) -> torch.Tensor:
        """Give the buffer its storage back (contents undefined until refilled)."""
        buffer = self.chunk.buffer
        if not self.resident:
            buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
            self.resident = True
        return buffer


class ChunkManager:
    """The trainable parameters of an optimizer's groups, packed into ParamChunks.

    ``segment_of`` (optional) gives parameters a segment id (e.g. the transformer block they
    belong to): a chunk then never holds parameters of two segments, and each run of
    consecutive parameters of one segment starts a new chunk.

    ``expert`` (optional) names expert parameters: they go into chunks of their own, after
    the group's others, padded to a multiple of ``expert_align`` (the ranks sharing them).

    ``lazy``: only the layout is made (chunk buffers on the meta device, no values copied);
    each ``ParamChunk.materialize`` then makes one chunk real on ``device`` (default: its
    parameters' device)."""

    def __init__(
        self,
        param_groups: list[dict],
        *,
        chunk_elems: int,
        align: int,
        segment_of: dict[nn.Parameter, int] | None = None,
        expert: set[nn.Parameter] | None = None,
        expert_align: int = 1,
        lazy: bool = False,
        device: torch.device | None = None,
    ):
        self.lazy, self.device = lazy, device
        self.chunks: list[ParamChunk] = []
        self.owner: dict[nn.Parameter, ParamChunk] = {}
        self.transitions = 0
        expert = expert or set()
        for gi, group in enumerate(param_groups):
            params = [p for p in group["params"] if p.requires_grad and p not in expert]
            for kind in (True, False):
                chosen = [p for p in params if tp_sharded(p) == kind]
                for run in _runs(chosen, segment_of or {}):
                    self._add(run, gi, kind, chunk_elems=chunk_elems, align=align)
            experts = [p for p in group["params"] if p.requires_grad and p in expert]
            for run in _runs(experts, segment_of or {}):
                self._add(run, gi, False, chunk_elems=chunk_elems, align=expert_align, expert=True)

    def transition(self, chunk, state: ChunkState) -> None:
        """The one place a chunk's state changes (``chunk`` has a ``state``: a tiered
        chunk of ``tessera.memory.store``); an illegal change is a bug, not a user error."""
        assert state in TRANSITIONS[chunk.state], f"{chunk}: {chunk.state.value} -> {state.value}"
        chunk.state = state
        self.transitions += 1

    def _add(
        self, params: list[nn.Parameter], gi: int, kind: bool, *, chunk_elems: int, align: int, expert=False
    ) -> None:
        device = local(params[0]).device
        if self.lazy:  # the layout alone: fp32 chunks on the meta device
            named = [(str(i), torch.empty(local(p).shape, device="meta")) for i, p in enumerate(params)]
            where = "meta"
        else:
            named = [(str(i), local(p.detach()).float()) for i, p in enumerate(params)]
            where = device
        for chunk in pack(named, chunk_elems=chunk_elems, align=align, device=where):
            pc = ParamChunk(chunk, [params[int(slot.name)] for slot in chunk.slots], gi, kind, expert)
            if self.lazy:
                pc.device = torch.device(self.device or device)
            self.chunks.append(pc)
            for p in pc.params:
                self.owner[p] = pc


def _runs(params: list[nn.Parameter], segment_of: dict[nn.Parameter, int]) -> list[list[nn.Parameter]]:
    """``params`` cut wherever the segment id changes (parameters without one: segment -1)."""
    runs: list[list[nn.Parameter]] = []
    last = object()
    for p in params:
        segment = segment_of.get(p, -1)
        if segment != last:
            runs.append([])
            last = segment
        runs[-1].append(p)
    return runs
