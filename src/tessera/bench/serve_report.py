"""The report of `tessera bench serve`: per model, Tessera against the best peer in the finals
(ratio of median saturations, the range of per-repeat ratios), every finalist's p99 at the
shared rate, the workers layouts; the memory plan's figures; the results table, notes and
plot."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from pathlib import Path

from tessera.bench.harness import BenchResult
from tessera.bench.serve_memory import memory_note, memory_table


def _spread(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 3),
        "range": [round(min(values), 3), round(max(values), 3)],
    }


def _model_headline(model: str, rows: list[dict], facts: dict) -> dict:
    """Tessera against the best peer in the finals: the ratio of median saturations and the
    range of per-repeat ratios (repeat i of both served the same requests), and the p99 of
    each at the one shared rate."""
    finals = [r for r in rows if r["model"] == model and r["phase"] == "final"]
    by = {}
    for r in finals:
        by.setdefault(r["system"], []).append(r)
    out = {"best_batch": facts["best_batch"], "shared_rate_rps": round(facts["shared_rate_rps"], 3)}
    for system, mine in by.items():
        out[f"{system}_saturation_rps"] = _spread([r["throughput_rps"] for r in mine])
    peers = [p for p in facts["peers_ranked"] if p in by]
    if "tessera" in by and peers:
        # the best peer in the finals (the sweep ranked them on other requests)
        best = max(peers, key=lambda p: statistics.median(r["throughput_rps"] for r in by[p]))
        ours = sorted(by["tessera"], key=lambda r: r["repeat"])
        theirs = sorted(by[best], key=lambda r: r["repeat"])
        ratios = [a["throughput_rps"] / b["throughput_rps"] for a, b in zip(ours, theirs, strict=True)]
        med = statistics.median(r["throughput_rps"] for r in ours) / statistics.median(
            r["throughput_rps"] for r in theirs
        )
        out |= {"best_peer": f"{best}@{facts['best_batch'][best]}", "tessera_over_best_peer": round(med, 3),
                "tessera_over_best_peer_range": [round(min(ratios), 3), round(max(ratios), 3)]}  # fmt: skip
        out |= _compute_bound(facts, {s: statistics.median(r["throughput_rps"] for r in by[s]) for s in ("tessera", best)}, best)
    shared: dict[str, list[dict]] = {}
    for r in rows:
        if r["model"] == model and r["phase"] == "shared_rate":
            shared.setdefault(r["system"], []).append(r)
    for system, mine in shared.items():  # median over the repeats, and their range
        p99 = [r["p99_s"] for r in mine]
        out[f"{system}_p99_at_shared_rate_s"] = round(statistics.median(p99), 4)
        out[f"{system}_p99_at_shared_rate_range_s"] = [round(min(p99), 4), round(max(p99), 4)]
    if "tessera" in shared and "best_peer" in out:
        # repeat i offered the same arrivals to both: the ratio of their p99s, repeat by repeat
        peer = shared.get(out["best_peer"].split("@")[0], [])
        pairs = {r.get("repeat", 0): r["p99_s"] for r in peer}
        ratios = [r["p99_s"] / pairs[r.get("repeat", 0)] for r in shared["tessera"] if pairs.get(r.get("repeat", 0))]
        if ratios:
            out["tessera_p99_over_best_peer_at_shared_rate"] = round(statistics.median(ratios), 3)
            out["tessera_p99_over_best_peer_at_shared_rate_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    layouts = {}
    for r in rows:
        if r["model"] == model and r["phase"] == "workers":
            layouts.setdefault(r["system"], []).append(r["throughput_rps"])
    if "tessera_1x2" in layouts and "tessera_2x1" in layouts:
        one, two = layouts["tessera_1x2"], layouts["tessera_2x1"]
        out["workers_2x1_over_1x2"] = round(statistics.median(two) / statistics.median(one), 3)
        out["workers_2x1_over_1x2_range"] = _spread([a / b for a, b in zip(two, one, strict=True)])["range"]
        peer = layouts.get("infinity_optimum_2cores")
        if peer:  # two cores each: Tessera's better layout against ONNX Runtime's default pool
            best = "tessera_2x1" if statistics.median(two) >= statistics.median(one) else "tessera_1x2"
            ours = layouts[best]
            out["two_cores"] = {
                "tessera_layout": best, "tessera_rps": _spread(ours), "infinity_optimum_rps": _spread(peer),
                "tessera_over_infinity_optimum": round(statistics.median(ours) / statistics.median(peer), 3),
                "range": _spread([a / b for a, b in zip(ours, peer, strict=True)])["range"],
            }  # fmt: skip
    return out


def _compute_bound(facts: dict, rps: dict[str, float], best: str) -> dict:
    """What the FMA peak allows: each system's useful GFLOP/s (saturation x the workload's
    GFLOP a request, unpadded) as a fraction of the peak measured on the servers' core around
    the finals, and the peak over the best peer's rate: the most any exact float32 server on
    that core could reach over that peer."""
    per, peaks = facts.get("gflop_per_request"), facts.get("fma_peak_gflops")
    if not per or not peaks:
        return {}
    peak = max(peaks)
    theirs, ours = rps[best] * per, rps["tessera"] * per
    return {"gflop_per_request": round(per, 2), "fma_peak_gflops_1_core": peaks,
            "tessera_fraction_of_peak": round(ours / peak, 3), "best_peer_fraction_of_peak": round(theirs / peak, 3),
            "peak_over_best_peer": round(peak / theirs, 3)}  # fmt: skip


def result(plan, rows, systems, absent, models, memory) -> BenchResult:
    headline = {model: _model_headline(model, rows, facts) for model, facts in models.items()}
    if memory:
        headline["memory_plan"] = {
            "max_footprint_over_peak_live": round(memory["max_ratio"], 3),
            "steady_state_allocations": memory["second_pass"]["allocations"],
            "held_over_largest_peak_live": round(memory["held_over_largest_peak"], 3),
            "second_pass_chunk_allocations": memory["second_pass"]["chunk_allocations"],
        }
    tessera_facts = {m: s.get("tessera", {}) for m, s in systems.items()}
    headline["dp_plan_us_per_request"] = _dp_speed(next(iter(tessera_facts.values()), {}))
    notes = [
        *(f"encoder {s.layers}x{s.hidden}: {s.family}, {s.heads} heads, random weights" for s in plan.specs),
        f"requests: one text each, uniform in [{plan.min_tokens}, {plan.max_tokens}] tokens; sweep: "
        f"{plan.sweep_requests} validation requests per configuration, batch sizes {plan.batch_sizes}; finals: "
        f"{plan.saturation_requests} requests x {plan.repeats} repeats from {plan.concurrency} closed-loop "
        f"clients after {plan.warmup_requests} warm-up; shared rate: {plan.shared_requests} open-loop Poisson "
        f"requests x {plan.repeats} repeats (repeat i the same arrivals for every system; p99 the median over "
        f"repeats, its range beside) at {plan.shared_fraction:.0%} of the best peer's sweep saturation",
        "servers pinned to one core with 1 torch thread and 1 ONNX Runtime thread (its default pool pins a "
        "worker to every core, whatever the process's affinity), the load generator to another core; the cores "
        "each server's threads could use, read back from /proc, are in the systems table",
        *[f"{name} absent: {why}" for name, why in absent.items()],
    ]
    extra = {"plan": {k: v for k, v in asdict(plan).items() if k != "specs"} | {"specs": [asdict(s) for s in plan.specs]},
             "systems": systems, "absent": absent, "models": models}  # fmt: skip
    columns = ["model", "phase", "system", "batch", "repeat", "offered_rps", "throughput_rps", "tokens_per_s",
               "p50_s", "p99_s", "goodput_rps", "ok", "errors"]  # fmt: skip
    batch_rows = [
        {"model": m, "system": k, **{f: v for f, v in s.items() if f != "cost_table"}}
        for m, by in systems.items()
        for k, s in by.items()
    ]
    batch_columns = [
        "model",
        "system",
        "batches",
        "mean_batch_size",
        "padding_overhead",
        "max_abs_diff_vs_model",
        "cpus_allowed",
        "threads",
    ]
    tables = [("Batches, padding, and each system's embeddings against the model run alone", batch_columns,
               batch_rows)]  # fmt: skip
    if memory:
        tables.append(memory_table(memory))
        notes.append(memory_note(memory))
        extra["memory_plan"] = memory
    return BenchResult("serve", headline, rows, columns, notes=notes, extra=extra, tables=tables)


def _dp_speed(tessera: dict) -> float | None:
    """The DP's planning time for a 256-request queue, on the measured cost table."""
    import random

    from tessera.serve.cost import CostTable
    from tessera.serve.dp_scheduler import DPScheduler
    from tessera.serve.request import Request
    from tessera.serve.scheduler import BatchLimits

    table = tessera.get("cost_table")
    if not table:
        return None
    scheduler = DPScheduler(BatchLimits(), CostTable.from_dict(table))
    rng = random.Random(0)
    queue = [Request([1] * rng.randint(5, 500)) for _ in range(256)]
    scheduler.plan(queue)
    began = time.perf_counter()
    for _ in range(10):
        scheduler.plan(queue)
    return round((time.perf_counter() - began) / 10 / 256 * 1e6, 2)


def plot_serve(result: BenchResult, path: Path) -> None:
    """Per model: the sweep (each peer's saturation against its batch size, Tessera's as a
    line) and the finals (median saturation with the repeats' range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in result.rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
    for (ax_sweep, ax_final), model in zip(axes, models, strict=True):
        sweep = [r for r in result.rows if r["model"] == model and r["phase"] == "sweep"]
        for system in dict.fromkeys(r["system"] for r in sweep):
            mine = sorted((r for r in sweep if r["system"] == system), key=lambda r: r["batch"] or 0)
            if mine[0]["batch"] is None:
                ax_sweep.axhline(mine[0]["throughput_rps"], linestyle="--", label=system)
            else:
                ax_sweep.plot([r["batch"] for r in mine], [r["throughput_rps"] for r in mine], marker="o",
                              label=system)  # fmt: skip
        ax_sweep.set_xscale("log", base=2)
        ax_sweep.set_xlabel("batch size (requests)")
        ax_sweep.set_ylabel("saturation (requests/s)")
        ax_sweep.set_title(f"{model}: sweep (validation requests)")
        ax_sweep.legend(fontsize=7)
        ax_sweep.grid(alpha=0.3)
        finals = [r for r in result.rows if r["model"] == model and r["phase"] == "final"]
        names = list(dict.fromkeys(r["system"] for r in finals))
        values = [[r["throughput_rps"] for r in finals if r["system"] == n] for n in names]
        med = [statistics.median(v) for v in values]
        err = [
            [m - min(v) for m, v in zip(med, values, strict=True)],
            [max(v) - m for m, v in zip(med, values, strict=True)],
        ]
        ax_final.bar(names, med, yerr=err, capsize=4)
        ax_final.set_ylabel("saturation (requests/s)")
        ax_final.set_title(f"{model}: finals (median, range of repeats)")
        ax_final.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax_final.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
