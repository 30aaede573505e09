"""The headline of `tessera bench kernels` from its rows: the win fraction and geometric mean
against the best anchor (medians and each timing round), with and without the weight packed
once on each side, SGEMM's fraction of the peak, tuning times, the model's rank correlation,
the algorithms chosen and TVM's comparison."""

from __future__ import annotations

import math
import statistics
from collections import Counter

from tessera.bench import kernels_anchors as ka

GIGA = 1e9


def either_side_prepacked(rows: list[dict]) -> dict:
    """The win fraction and geomean when each side may pack its weight once, outside the timing:
    the anchors' figures already take MKL's packed SGEMM and oneDNN's reordered weights where
    faster; Tessera's take its prepacked call where faster (GEMM rows, and conv rows whose schedule
    takes a packed weight). Medians and each round."""

    def scored(rs):
        out = []
        for r in rs:
            mine = {**r, "gflops": max(r["gflops"], r.get("tessera_prepacked_gflops") or 0.0)}
            ka.best_anchor(mine)
            out.append(mine)
        return ka.anchor_headline(out, {}, {})

    if not any(r.get("tessera_prepacked_gflops") for r in rows):
        return {}
    per = [scored(ka.round_rows(rows, i)) for i in range(min(len(r.get("rounds", ())) for r in rows))]
    med = scored(rows)
    return {
        "win_fraction_either_side_prepacked": med["win_fraction_vs_best_anchor"],
        "geomean_either_side_prepacked": med["geomean_vs_best_anchor"],
        "win_fraction_either_side_prepacked_rounds": [p["win_fraction_vs_best_anchor"] for p in per],
        "geomean_either_side_prepacked_rounds": [p["geomean_vs_best_anchor"] for p in per],
    }


def same_moment_fractions(rows: list[dict], shape: str | None) -> dict:
    """``shape``'s (the largest square SGEMM's) GFLOP/s over the FMA peak probed in the same
    timing round, per thread count: the median over rounds, and each round's; where the row ran
    the AMX kernel, its FMA kernel's too (``fma_``: AMX is not bound by the FMA peak)."""
    out = {}
    for r in rows:
        if r["shape"] != shape or not all(x.get("peak_gflops") for x in r.get("rounds", [])):
            continue
        n = shape.split("^")[0]
        for key, tag in (("gflops", ""), ("tessera_fma_gflops", "fma_")):  # the row's kernel; its FMA one under AMX
            if not all(x.get(key) for x in r["rounds"]):
                continue
            per_round = [round(x[key] / x["peak_gflops"], 3) for x in r["rounds"]]
            out[f"sgemm_{n}_{tag}fraction_of_same_moment_peak_{r['threads']}_thread"] = statistics.median(per_round)
            out[f"sgemm_{n}_{tag}fraction_of_same_moment_peak_{r['threads']}_thread_rounds"] = per_round
    return out


def headline(rows, machine, validation, tvm_note, curves, anchor_report, absent) -> dict:
    for r in rows:
        ka.best_anchor(r)
    squares = [r for r in rows if r["kind"] == "gemm" and r["threads"] == 1 and r["shape"].endswith("^3")]
    top = next((r for r in squares if r["shape"] == "2048^3"), squares[-1] if squares else None)
    peak = machine.peak(1)
    rhos = [r["spearman"] for r in rows if r["spearman"] == r["spearman"]]  # nan: fewer than 3 candidates
    h = {
        "peak_gflops_1_thread": round(peak / GIGA, 2),
        "isa": machine.isa,
        f"sgemm_{top['shape'].split('^')[0]}_fraction_of_peak_1_thread" if top else "sgemm": (
            round(top["gflops"] * GIGA / peak, 3) if top else None),
        **({f"sgemm_{top['shape'].split('^')[0]}_vs_best_anchor_1_thread": top["vs_best_anchor"]} if top else {}),
        **same_moment_fractions(rows, top["shape"] if top else None),
        **ka.anchor_headline(rows, absent, anchor_report),
        **ka.rounds_headline(rows),
        "shapes": len(rows),
        "tuning_seconds_per_shape_median": round(statistics.median(r["tuning_s"] for r in rows), 2),
        "tuning_seconds_per_shape_max": round(max(r["tuning_s"] for r in rows), 2),
        "spearman_shortlist_median": round(statistics.median(rhos), 3) if rhos else None,
        "spearman_validation": [v["spearman"] for v in validation],
        "algorithms_chosen": dict(sorted(Counter(r["algorithm"] for r in rows).items())),
        "model_algorithm_kept_fraction": round(
            sum(r["algorithm"] == r["model_algorithm"] for r in rows) / len(rows), 3) if rows else None,
    }
    # like for like with MKL's packed SGEMM (the weight packed once, outside the timing, on both
    # sides): not in the win fraction above, which takes Tessera's plain call
    both = [r for r in rows if r.get("tessera_prepacked_gflops") and r.get("torch_mkl_packed_gflops")]
    h.update(either_side_prepacked(rows))
    if both:
        h["prepacked_vs_mkl_packed_geomean"] = round(math.exp(statistics.fmean(
            math.log(r["tessera_prepacked_gflops"] / r["torch_mkl_packed_gflops"]) for r in both)), 3)
        h["prepacked_faster_than_plain_rows"] = sum(r["tessera_prepacked_gflops"] > r["gflops"] for r in both)
        h["prepacked_rows"] = len(both)
    tvm = [r for r in rows if "tvm_gflops" in r]
    if tvm:
        at_least = [r for r in tvm if r["gflops"] >= r["tvm_gflops"]]  # Tessera at equal or better speed
        h["tvm_trials_per_shape"] = tvm[0]["tvm_trials"]
        h["tvm_shapes"] = len(tvm)
        h["tvm_shapes_tessera_at_least_as_fast"] = len(at_least)
        h["tvm_tuning_seconds_median"] = round(statistics.median(r["tvm_tuning_s"] for r in tvm), 1)
        h["tuning_time_over_tvm_median"] = (
            round(statistics.median(r["tuning_s"] / r["tvm_tuning_s"] for r in at_least), 3) if at_least else None)
        h["speed_over_tvm_median"] = round(statistics.median(r["gflops"] / r["tvm_gflops"] for r in tvm), 2)
        h["tvm_matches_tessera_after_s"] = {r["shape"]: r["tvm_matches_tessera_after_s"] for r in tvm}
    else:
        h["tvm"] = f"absent: {tvm_note}" if tvm_note else "not run: this plan has no TVM shapes"
    if curves:
        h["train_max_loss_gap"] = curves["max_abs_gap"]
    return h
