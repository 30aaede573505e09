"""The memory plan on the benchmark's model and workload, in this process (no HTTP): the
length-aware plan (`tessera.serve.arena`) against the peak of live bytes of each batch,
what it holds across batches, whether a second pass over the same batches asks the
allocator for anything, and what the plan costs in time against the default runner.

Batches: the saturation workload sorted by length and cut into runs (the DP scheduler's
contiguous batches), plus arrival-order batches of the padded budget's size (FIFO's)."""

from __future__ import annotations

import time
from pathlib import Path


def workload_batches(lengths: list[int], *, run: int, fifo: int, max_batch_tokens: int) -> list[list[int]]:
    ordered = sorted(lengths)
    batches = [ordered[i : i + run] for i in range(0, len(ordered), run)]
    for i in range(0, len(lengths), fifo):
        batch = lengths[i : i + fifo]
        while max(batch) * len(batch) > max_batch_tokens:
            batch = batch[:-1]
        batches.append(batch)
    return batches


def measure_memory_plan(folder: Path, lengths: list[int], *, run: int = 8, fifo: int = 32,
                        max_batch_tokens: int = 16384) -> dict:  # fmt: skip
    import torch

    from tessera.serve.model import load_model
    from tessera.serve.unpadded import UnpaddedRunner

    torch.set_num_threads(1)
    served = load_model(folder)
    planned = UnpaddedRunner(served, attention="padded", memory_plan=True)
    default = UnpaddedRunner(served)
    arena = planned.arena
    batches = [[[2] + [7] * (n - 2) + [3] for n in b] for b in workload_batches(
        lengths, run=run, fifo=fifo, max_batch_tokens=max_batch_tokens)]  # fmt: skip
    rows, seconds = [], {"planned": 0.0, "default": 0.0}
    for sequences in batches:  # first pass: plans made, chunks allocated as needed
        began = time.perf_counter()
        planned(sequences)
        seconds["planned"] += time.perf_counter() - began
        began = time.perf_counter()
        default(sequences)
        seconds["default"] += time.perf_counter() - began
        plan = arena.last_plan
        rows.append({"inputs": len(sequences), "tokens": sum(map(len, sequences)),
                     "peak_live_mib": plan.peak_live / 2**20, "footprint_mib": plan.footprint / 2**20,
                     "ratio": plan.footprint / plan.peak_live})  # fmt: skip
    before = dict(arena.stats)
    for sequences in batches:  # second pass, the same shapes: steady state
        planned(sequences)
    after = arena.stats
    ratios = [r["ratio"] for r in rows]
    big = [r["ratio"] for r in rows if r["peak_live_mib"] >= 16]  # several chunks' worth
    return {
        "batches": rows,
        "max_ratio": max(ratios),
        "max_ratio_over_16_mib": max(big) if big else None,
        "mean_ratio": sum(ratios) / len(ratios),
        "held_mib": arena.held_bytes() / 2**20,
        "largest_peak_live_mib": max(r["peak_live_mib"] for r in rows),
        "held_over_largest_peak": arena.held_bytes() / 2**20 / max(r["peak_live_mib"] for r in rows),
        "second_pass": {k: after[k] - before[k] for k in ("plans", "chunk_allocations", "allocations")},
        "first_pass": {k: before[k] for k in ("plans", "plans_anew", "chunk_allocations", "allocations")},
        "planned_over_default_seconds": seconds["planned"] / seconds["default"],
    }


def memory_table(memory: dict) -> tuple[str, list[str], list[dict]]:
    title = "Memory plan: each batch's footprint against its peak of live bytes (first pass)"
    return title, ["inputs", "tokens", "peak_live_mib", "footprint_mib", "ratio"], memory["batches"]


def memory_note(memory: dict) -> str:
    return (
        f"memory plan: footprint / peak live at most {memory['max_ratio']:.3f} (mean {memory['mean_ratio']:.3f}); "
        f"held {memory['held_mib']:.1f} MiB after all batches, {memory['held_over_largest_peak']:.2f}x the largest "
        f"peak ({memory['largest_peak_live_mib']:.1f} MiB); "
        f"second pass over the same batches: {memory['second_pass']}; planned forward time / the default "
        f"runner's {memory['planned_over_default_seconds']:.2f}"
    )
