"""Chunks: fixed-size flat buffers holding many tensors in a known order (PatrickStar,
Fang et al. 2021). Parameters, gradients and optimizer states live in chunks so that
whole chunks can be moved between memory tiers, sharded over ranks, or communicated in
one collective, instead of tensor by tensor.

A chunk's capacity is padded to a multiple of ``align`` (the data-parallel world size),
so every chunk splits into equal shards. A tensor larger than the chunk size gets a chunk
of its own; tensors never straddle chunks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ChunkKind(enum.Enum):
    """What a chunk holds. ``PARAM`` is a rank's fp32 master shard of a chunk of parameters,
    ``PARAM_LOW`` its bf16 copy (offloaded under bf16 autocast: what forward and backward
    move and all-gather, half the bytes), ``COMPUTE`` the whole chunk the modules compute
    with (all-gathered from the shards), ``GRAD`` the rank's reduced gradient shard, ``OPTIM``
    one per-element optimizer state of a shard (Adam's two moments are two chunks)."""

    PARAM = "param"
    PARAM_LOW = "param_low"
    COMPUTE = "compute"
    GRAD = "grad"
    OPTIM = "optim"


class ChunkState(enum.Enum):
    """A chunk's state, as PatrickStar has them (section 4). Only a chunk not in ``COMPUTE``
    may move between tiers; every use passes through ``COMPUTE``."""

    FREE = "free"  # no data yet (a gradient before backward, a state before its first step)
    COMPUTE = "compute"  # in use now, on the compute tier
    HOLD = "hold"  # data kept, not in use (after the optimizer step)
    HOLD_AFTER_FWD = "hold_after_fwd"  # used by forward, next needed by backward
    HOLD_AFTER_BWD = "hold_after_bwd"  # used by backward, next needed by the optimizer step
    RELEASED = "released"  # data consumed and dropped (a gradient after the step)


_USE = {ChunkState.COMPUTE}
TRANSITIONS: dict[ChunkState, set[ChunkState]] = {
    ChunkState.FREE: _USE,
    ChunkState.COMPUTE: {
        ChunkState.HOLD,
        ChunkState.HOLD_AFTER_FWD,
        ChunkState.HOLD_AFTER_BWD,
        ChunkState.RELEASED,
    },
    ChunkState.HOLD: _USE,
    ChunkState.HOLD_AFTER_FWD: _USE,
    ChunkState.HOLD_AFTER_BWD: _USE,
    ChunkState.RELEASED: _USE,
}


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class Chunk:
    capacity: int
    dtype: torch.dtype
    device: torch.device | str = "cpu"
    slots: list[Slot] = field(default_factory=list)
    buffer: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.buffer = torch.zeros(self.capacity, dtype=self.dtype, device=self.device)

    @property
    def used(self) -> int:
        return self.slots[-1].offset + self.slots[-1].numel if self.slots else 0

    def fits(self, numel: int) -> bool:
        return self.used + numel <= self.capacity

    def append(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` in; returns the view of the chunk that now holds it."""
        if tensor.dtype != self.dtype:
            raise ValueError(f"tensor {name!r} is {tensor.dtype}, but this chunk holds {self.dtype}")
        if not self.fits(tensor.numel()):
            raise ValueError(
                f"tensor {name!r} ({tensor.numel()} elements) does not fit: {self.capacity - self.used} free"
            )
        slot = Slot(name, self.used, tensor.shape)
        self.slots.append(slot)
        view = self.view(slot)
        view.copy_(tensor.detach())
        return view

    def view(self, slot: Slot) -> torch.Tensor:
        return self.buffer[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def trim(self, align: int = 1) -> None:
        """Shrink the capacity to what is used, rounded up to a multiple of ``align`` (the
        last chunk of a model is usually far from full)."""
        capacity = self.used + (-self.used % align)
        if capacity < self.capacity:
            self.buffer = self.buffer[:capacity].clone()
            self.capacity = capacity

    def shard(self, rank: int, world: int) -> torch.Tensor:
        """Rank ``rank``'s equal 1/``world`` of the buffer (capacity is a multiple of ``world``)."""
        assert self.capacity % world == 0, "chunk capacity must be padded to the world size"
        size = self.capacity // world
        return self.buffer[rank * size : (rank + 1) * size]


def pack(
    named: list[tuple[str, torch.Tensor]],
    *,
    chunk_elems: int,
    align: int = 1,
    device: torch.device | str = "cpu",
) -> list[Chunk]:
    """Tensors, in the given order, into chunks of ``chunk_elems`` elements (rounded up to a
    multiple of ``align``); a tensor larger than that gets a chunk of exactly its size
    (rounded up likewise). Tensors of different dtypes go to different chunks. Each chunk is
    then trimmed to what it holds (rounded up to ``align``)."""
    if chunk_elems < 1 or align < 1:
        raise ValueError(f"chunk_elems and align must be >= 1, got {chunk_elems} and {align}")
    chunks: list[Chunk] = []
    open_chunk: dict[torch.dtype, Chunk] = {}
    for name, tensor in named:
        current = open_chunk.get(tensor.dtype)
        if current is None or not current.fits(tensor.numel()):
            capacity = max(chunk_elems, tensor.numel())
            current = Chunk(capacity + (-capacity % align), tensor.dtype, device)
            chunks.append(current)
            open_chunk[tensor.dtype] = current
        current.append(name, tensor)
    for chunk in chunks:
        chunk.trim(align)
    return chunks
