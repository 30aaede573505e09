"""Which regions to chunk and how finely.

Repeatedly: find the step of the schedule where estimated activation memory peaks; try
every node in a window after it as the end of a region, along each of its dimensions; keep
the region that lowers the whole graph's peak the most (scored at one row per slice, the
least memory that region can reach). Stop when the highest unchunked step is no higher
than what the chunked loops need at their finest, or nothing helps.

Then choose slice sizes: each loop gets the largest slice whose step stays under the
target, the slice costed by running the loop body on fake tensors. With a budget the target
is the budget (an error with the numbers if the floor is above it); without one it is the
highest unchunked step, or a loop's own floor plus ``slack`` when that is higher, so no loop
is cut finer than the graph as a whole needs. A loop that needs no slicing is dropped (its
nodes run whole) unless, with a budget, that would not fit. Last, each loop's output is
written into a dying input where ``memory.py`` allows it, or laid out for the einsum that
reads it (``layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessera.autochunk.layout import output_layouts
from tessera.autochunk.loops import Region
from tessera.autochunk.memory import MemoryModel, Timeline
from tessera.autochunk.region import build_region
from tessera.autochunk.rules import shape

MiB = 1024 * 1024


class BudgetError(ValueError):
    """max_memory is below the least activation memory chunking can reach."""


@dataclass(frozen=True)
class ChunkPlan:
    regions: list[Region]
    original_peak: int
    estimated_peak: int
    floor_peak: int
    peak_node: str

    def describe(self) -> str:
        lines = [
            f"activation peak {self.original_peak / MiB:.1f} MiB -> {self.estimated_peak / MiB:.1f} MiB "
            f"(estimated; floor {self.floor_peak / MiB:.1f} MiB), {len(self.regions)} chunked region(s)"
        ]
        for r in self.regions:
            into = f", written into {r.into.name}" if r.into is not None else ""
            into += f", laid out in memory as dims {r.layout}" if r.layout is not None else ""
            lines.append(
                f"  {r.end.name}: {len(r.dims)} nodes along dim {r.dims[r.end]} "
                f"(length {r.length}) in slices of {r.chunk}{into}"
            )
        return "\n".join(lines)


def _at(regions: list[Region], chunk: int | None = None) -> list[Region]:
    return [replace(r, chunk=chunk if chunk is not None else r.chunk) for r in regions]


def _plain_peak(line: Timeline) -> tuple[int, int]:
    best, where = 0, -1
    for i, (step, b) in enumerate(zip(line.steps, line.bytes_at, strict=True)):
        if step.region is None and b > best:
            best, where = b, i
    return best, where


def _loop_bytes(
    model: MemoryModel, line: Timeline, region: Region, chunk: int, *, measured: bool = True
) -> int:
    """The loop step's bytes at ``chunk`` given a measured timeline computed with ``region.chunk``;
    the slice measured by running it on fake tensors, or (``measured=False``) scaled."""
    i = next(i for i, s in enumerate(line.steps) if s.region is not None and s.region.end is region.end)
    inner = model.slice_bytes(region, chunk) if measured else model.inner_peak(region, chunk)
    return line.bytes_at[i] - model.slice_bytes(region) + inner


def _largest_chunk(model: MemoryModel, line: Timeline, region: Region, target: int) -> int:
    """The largest slice whose loop step fits ``target``: searched with the scaled cost (cheap),
    checked by running the body at it, and searched again, measured, below it if it does not fit."""

    def search(hi: int, measured: bool) -> int:
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _loop_bytes(model, line, region, mid, measured=measured) <= target:
                lo = mid
            else:
                hi = mid - 1
        return lo

    chunk = search(region.length, measured=False)
    if chunk > 1 and _loop_bytes(model, line, region, chunk) > target:
        chunk = search(chunk - 1, measured=True)
    return chunk


def _sized(model: MemoryModel, regions: list[Region], target: int, *, drop: bool) -> list[Region]:
    """Each region at its largest slice under ``target``. With ``drop``, a region whose largest
    slice is its whole length is left out (computed unchunked) and the others are sized again
    for the schedule without it; otherwise it stays, one slice long."""
    kept = _at(regions, 1)
    while True:
        line = model.timeline(kept, measured=True)
        sized = [replace(r, chunk=_largest_chunk(model, line, r, target)) for r in kept]
        sliced = [r for r in sized if r.chunk < r.length]
        if not drop or len(sliced) == len(sized):
            return sized
        kept = _at(sliced, 1)


def plan(
    model: MemoryModel,
    *,
    max_memory: int | None = None,
    max_regions: int = 32,
    window: int = 48,
    slack: float = 1.1,
) -> ChunkPlan:
    original = model.timeline([])
    regions: list[Region] = []
    while len(regions) < max_regions:
        line = model.timeline(_at(regions, 1))
        plain, where = _plain_peak(line)
        loops = max(
            (b for s, b in zip(line.steps, line.bytes_at, strict=True) if s.region is not None), default=0
        )
        if where < 0 or plain <= loops:
            break
        taken = {n for r in regions for n in r.dims if n not in r.copies}
        pinned = frozenset(n for r in regions for n, _ in r.inputs)
        start = model.order[line.steps[where].node]
        # A region is worth taking if it lowers the peak, or (when several steps share the
        # peak) lowers the memory summed over all steps without raising the peak.
        best, best_score = None, (line.peak, sum(line.bytes_at) * 0.99)
        for end in model.nodes[start : start + window]:
            out = shape(end)
            if out is None or end in taken:
                continue
            for d in range(len(out)):
                for region in build_region(model, end, d, taken, pinned):
                    trial = model.timeline(_at(regions + [region], 1))
                    score = (trial.peak, sum(trial.bytes_at))  # ties on the peak: less memory overall
                    if score < best_score:
                        best, best_score = region, score
        if best is None:
            break
        regions.append(best)

    floor_line = model.timeline(_at(regions, 1), measured=True)
    floor = floor_line.peak
    plain, _ = _plain_peak(floor_line)
    if max_memory is not None:
        if floor > max_memory:
            step = floor_line.peak_step
            raise BudgetError(
                f"max_memory {max_memory / MiB:.1f} MiB is below what chunking can reach: the least "
                f"estimated activation peak is {floor / MiB:.1f} MiB (at node {step.node.name!r}"
                f"{', a chunked region at one row per slice' if step.region else ', which no region can slice'}"
                f"); unchunked it is {original.peak / MiB:.1f} MiB"
            )
        target = max_memory
    else:
        loop_floor = max(
            (b for s, b in zip(floor_line.steps, floor_line.bytes_at, strict=True) if s.region), default=0
        )
        target = max(plain, int(loop_floor * slack))
    chosen = _sized(model, regions, target, drop=True)
    final = model.timeline(chosen, measured=True)
    if max_memory is not None and final.peak > max_memory:  # a dropped loop's nodes, run whole, did not fit
        chosen = _sized(model, regions, target, drop=False)
        final = model.timeline(chosen, measured=True)
    chosen = [replace(r, into=final.into.get(r.end)) for r in chosen]
    layouts = output_layouts(chosen, set(model.output.all_input_nodes))
    laid = [replace(r, layout=layouts.get(r.end)) for r in chosen]
    laid_line = model.timeline(laid, measured=True)
    if max_memory is None or laid_line.peak <= max_memory:  # the layouts change what slices copy
        chosen, final = laid, laid_line
    return ChunkPlan(
        regions=chosen,
        original_peak=original.peak,
        estimated_peak=final.peak,
        floor_peak=floor,
        peak_node=final.peak_step.node.name if final.steps else "",
    )
