"""TurboTransformers' sequence-length-aware memory plan (Fang et al., PPoPP 2021, section
4.3; `ChunkedGreedyBySizeOffsetCalculation` in its allocator): the activation tensors of
one forward are known ahead with their sizes and lifetimes (first and last op that touch
them); place them, largest first, into chunks of memory, each at the start of the
smallest gap that fits between the tensors already in that chunk whose lifetimes overlap
it (best fit), in the first chunk (in the order they were made) where such a gap exists; when none
has, add a chunk of max(2 MiB, 1.2 x the tensor). Chunks live on between batches, so a
new batch's plan reuses them and only adds memory when it needs more than is held.

This module is the algorithm on usage records; `arena.py` makes a forward use the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 2**20
CHUNK_BYTES = 2 * MiB  # TurboTransformers' DEFAULT_TRUNK_SIZE
NEW_CHUNK_SCALE = 1.2  # its K_SCALE: a tensor bigger than a chunk gets 1.2x its size
ALIGN = 64  # bytes: every tensor starts on a cache line (and any dtype's alignment)


@dataclass(frozen=True)
class Usage:
    """One tensor: ``size`` bytes, alive from op ``first`` to op ``last`` (inclusive)."""

    size: int
    first: int
    last: int

    def overlaps(self, other: Usage) -> bool:
        return max(self.first, other.first) <= min(self.last, other.last)


@dataclass
class _Chunk:
    size: int
    placed: list[tuple[int, int, Usage]] = field(default_factory=list)  # (offset, bytes, usage), by offset

    def best_fit(self, nbytes: int, usage: Usage) -> int | None:
        best, smallest, end = None, None, 0
        for offset, size, other in self.placed:
            if not usage.overlaps(other):
                continue
            gap = offset - end
            if gap >= nbytes and (smallest is None or gap < smallest):
                best, smallest = end, gap
            end = max(end, offset + size)
        if best is None and self.size - end >= nbytes:
            best = end
        return best

    def put(self, offset: int, nbytes: int, usage: Usage) -> None:
        self.placed.append((offset, nbytes, usage))
        self.placed.sort(key=lambda p: p[0])


@dataclass
class MemoryPlan:
    placements: list[tuple[int, int]]  # per usage record: (chunk index, byte offset)
    chunk_sizes: list[int]  # every chunk the arena holds after planning (existing + new)
    used_chunks: list[int]  # indices of the chunks this plan uses
    new_chunks: int  # chunks this plan had to add
    peak_live: int  # the most bytes alive at once (the lower bound on any placement)

    @property
    def footprint(self) -> int:
        return sum(self.chunk_sizes[i] for i in self.used_chunks)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def peak_live_bytes(usages: list[Usage]) -> int:
    events = sorted(
        [(u.first, aligned(u.size)) for u in usages] + [(u.last + 1, -aligned(u.size)) for u in usages]
    )
    live = peak = 0
    for _, delta in events:  # at equal times frees (negative) come first: sorted puts them first
        live += delta
        peak = max(peak, live)
    return peak


def plan_memory(
    usages: list[Usage], chunk_sizes: list[int] | None = None, *, new_chunk_scale: float = NEW_CHUNK_SCALE
) -> MemoryPlan:
    """Place ``usages`` into the chunks of ``chunk_sizes`` (already held), adding chunks
    where they do not fit.

    Chunks are tried in the order they were made (as TurboTransformers walks its chunk
    list). That makes a plan reproducible: planning the same records again on the chunks a
    plan left gives the same placements and adds nothing, since each tensor meets the
    same chunks in the same state as the first time (by induction over the tensors)."""
    chunks = [_Chunk(size) for size in chunk_sizes or []]
    held = len(chunks)
    placements: list[tuple[int, int] | None] = [None] * len(usages)
    order = sorted(range(len(usages)), key=lambda i: (-usages[i].size, usages[i].first))
    for i in order:
        usage, nbytes = usages[i], aligned(usages[i].size)
        for c in range(len(chunks)):  # in the order they were made: see plan_memory's docstring
            offset = chunks[c].best_fit(nbytes, usage)
            if offset is not None:
                chunks[c].put(offset, nbytes, usage)
                placements[i] = (c, offset)
                break
        else:
            size = max(CHUNK_BYTES, aligned(int(nbytes * new_chunk_scale)))
            chunks.append(_Chunk(size))
            chunks[-1].put(0, nbytes, usage)
            placements[i] = (len(chunks) - 1, 0)
    used = sorted({c for c, _ in placements})
    return MemoryPlan(placements, [c.size for c in chunks], used, len(chunks) - held, peak_live_bytes(usages))
