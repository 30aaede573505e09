"""The report of `tessera bench stencil`: its headline (bandwidth probes, roofline, STREAM and
bound fractions, Devito's ratios), its notes and its figure."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tessera.bench.harness import BenchResult
from tessera.bench.stencil_roofline import PROBE_GROUP, BandwidthLog

if TYPE_CHECKING:
    from tessera.bench.stencil import StencilPlan

def _fractions(ours: dict, word: str, key: str = "roofline_fraction") -> dict:
    """min and max of ``key`` over the cases whose name holds ``word``."""
    got = [r[key] for c, r in ours.items() if word in c and key in r]
    return {"min": round(min(got), 3), "max": round(max(got), 3)} if got else {"min": None, "max": None}


def _geomean(values: list[float]) -> float | None:
    return round(math.exp(statistics.fmean(math.log(x) for x in values)), 3) if values else None


def headline(rows: list[dict], sweep: dict, log: BandwidthLog, plan: StencilPlan, devito_note: str) -> dict:
    ours = {r["case"]: r for r in rows if r["method"] == "tessera" and r.get("grid") == plan.grid}
    large = {r["case"]: r for r in rows if r["method"] == "tessera" and r.get("grid") == plan.large_grid}
    var, const = _fractions(ours, "variable"), _fractions(ours, "constant")
    devito = [r for r in rows if r["method"] == "devito" and "vs_tessera" in r and r["case"] in ours]
    ratios = {r["case"]: r["vs_tessera"] for r in devito}  # Devito's sweep / Tessera's, timed side by side
    raw = {r["case"]: ours[r["case"]]["gpts_s"] / r["gpts_s"] for r in devito}  # minutes apart
    spreads = [r["fraction_max"] - r["fraction_min"] for r in rows if "fraction_max" in r and r["method"] != "devito"]
    probes = log.summary()
    same = [r["same_memory_gbs"] for r in ours.values() if "same_memory_gbs" in r]
    head = {
        "threads": plan.threads,
        "dram_read_gbs_median": probes.get("read_gbs_median"),
        "dram_read_gbs_min": probes.get("read_gbs_min"),
        "dram_read_gbs_max": probes.get("read_gbs_max"),
        "dram_write_gbs_median": probes.get("write_gbs_median"),
        "bandwidth_probes": probes["probes"],
        **{k: v for k, v in probes.items() if k.startswith("stream_")},
        "same_memory_gbs_median": round(statistics.median(same), 2) if same else None,
        "same_memory_gbs_min": min(same) if same else None,
        "same_memory_gbs_max": max(same) if same else None,
        "dram_read_sweep_gbs": round(sweep["read"] / 1e9, 2),
        "dram_read_one_stream_gbs": round(sweep["one_stream"] / 1e9, 2),
        "roofline_fraction_variable_min": var["min"],
        "roofline_fraction_variable_max": var["max"],
        "roofline_fraction_constant_min": const["min"],
        "roofline_fraction_constant_max": const["max"],
        "roofline_fraction_round_spread_max": round(max(spreads), 3) if spreads else None,
        **{f"stream_fraction_{kind}_{end}": v for kind, word in (("variable", "variable"), ("constant", "constant"))
           for end, v in _fractions(ours, word, "stream_fraction").items()},  # fmt: skip
        "bound_fraction_min": min((r["bound_fraction"] for r in ours.values() if "bound_fraction" in r),
                                  default=None),  # fmt: skip
        "speed_vs_devito_geomean": round(math.exp(statistics.fmean(math.log(x) for x in ratios.values())), 3)
        if ratios
        else None,
        "speed_vs_devito_min": round(min(ratios.values()), 3) if ratios else None,
        "speed_vs_devito_max": round(max(ratios.values()), 3) if ratios else None,
        "speed_vs_devito_unpaired_geomean": _geomean([r["vs_tessera_unpaired"] for r in devito
                                                      if "vs_tessera_unpaired" in r]),  # fmt: skip
        "speed_vs_devito_round_range": [min(r["vs_tessera_min"] for r in devito),
                                        max(r["vs_tessera_max"] for r in devito)] if devito else None,  # fmt: skip
        "time_ratio_vs_devito_geomean": round(math.exp(statistics.fmean(math.log(x) for x in raw.values())), 3)
        if raw
        else None,
        "devito": devito_note,
    }
    if large:
        fr = [r["roofline_fraction"] for r in large.values()]
        head.update(large_grid=plan.large_grid, roofline_fraction_large_min=round(min(fr), 3),
                    roofline_fraction_large_max=round(max(fr), 3))
    by = {(r["case"], r["method"]): r for r in rows}
    und, dec = (
        by.get(("ete73 variable", "tessera undecomposed")),
        by.get(("ete73 variable", "tessera decomposed")),
    )
    head["decomposition_gain_ete73_variable"] = round(und["ms"] / dec["ms"], 3) if und and dec else None
    wave = [r for r in rows if r["case"].startswith("wave")]
    if len(wave) > 1:
        head["temporal_blocking_gain_wave"] = round(wave[0]["ms"] / min(r["ms"] for r in wave), 3)
    return head


def notes(plan: StencilPlan, sweep: dict, log: BandwidthLog, devito_note: str, skipped: list[str]) -> list[str]:
    probes = log.summary()
    return [
        f"{plan.threads} threads for Tessera, torch and Devito (OMP_NUM_THREADS={plan.threads}, DEVITO_LANGUAGE=openmp,"
        " opt='advanced', autotuning='aggressive'); numpy is single-threaded.",
        f"grid {plan.grid}^3 interior, float32; variable = one coefficient array per offset; roofline = the ideal "
        "traffic (each coefficient array and the field read once, the output written once) timed on the case's own "
        f"buffers (plain vector loads, {PROBE_GROUP} arrays at a time, and stores) right before and after each timed sweep: "
        "this VM's bandwidth moves within seconds, so a sweep is only compared with the machine of its moment.",
        f"Tessera rows: {plan.rounds} sweeps of each kernel compared (best undecomposed and best decomposed, "
        "interleaved), each between two probes; roofline_fraction is the median over sweeps of (mean of its two "
        "probes) / (its time), fraction_min/max their range; same_memory_gbs = ideal bytes / median probe; "
        "incore_ms = the in-core bound of the row's schedule (its FMAs and its loads, the distinct field values of "
        "its jammed rows plus each coefficient array and the output, at two of each a cycle a core); "
        "bound_fraction = the longer of the DRAM bound (median probe) and the in-core bound / the row's time. "
        "numpy, torch and Devito are divided by the case's median probe. speed_vs_devito: Devito (its own venv) and "
        "Tessera's compiled kernel (the case's fastest) each in a process of its own, on bit-identical field and "
        f"coefficient arrays, {plan.rounds} rounds interleaved (order alternating), each round 4 sweeps of each; "
        "vs_tessera = median over rounds of Devito's sweep / Tessera's (paired; range in vs_tessera_min/max), "
        "vs_tessera_unpaired = median / median (range: extreme over extreme); time_ratio_vs_devito compares times "
        "minutes apart.",
        f"Fresh-buffer DRAM probes (best of 8 and 16 streams over 1 GiB; one per case, the machine's drift): "
        f"{probes['probes']}, read median {probes.get('read_gbs_median')} GB/s, range "
        f"{probes.get('read_gbs_min')}-{probes.get('read_gbs_max')}; write median {probes.get('write_gbs_median')} GB/s.",
        "STREAM-class probe before and after each case (copy c = a and triad a = b + s c, plain and non-temporal "
        "stores, three arrays far past the last-level cache, bytes counted as STREAM counts them): medians "
        + ", ".join(f"{k.removeprefix('stream_').removesuffix('_gbs_median')} {v} GB/s" for k, v in probes.items()
                    if k.startswith("stream_"))
        + "; stream_fraction = the row's ideal bytes / its time / the better kernel's mean of the two probes "
        "around its case (roofline_fraction divides by the own-buffer probe instead).",
        f"The bandwidth sweep at the start: one stream {sweep['one_stream'] / 1e9:.1f} GB/s; k streams at once "
        + ", ".join(f"k={k} {v / 1e9:.1f}" for k, v in sweep["by_streams"].items())
        + f"; write {sweep['write'] / 1e9:.1f} GB/s.",
        "Devito's time is its own operator timer per sweep (a 4-step time loop, as its autotuner needs one); "
        "its answer checked on a 9x10x23 grid against float64.",
        f"Devito: {devito_note}.",
        f"Larger grid {plan.large_grid}^3: Tessera alone (tuner top 2, {max(2, plan.rounds - 4)} sweeps); "
        + (f"skipped for memory: {', '.join(skipped)}." if skipped else "every case fitted."),
    ]


def plot_stencil(result: BenchResult, path: Path) -> None:
    """Left: the memory roofline (measured bandwidth) with each case's GFLOP/s by method.
    Right: GPts/s per case and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows if "gpts_s" in r and not r["case"].startswith("wave") and "^3" not in r["case"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    head = result.headline
    methods = sorted({r["method"] for r in rows})
    for i, method in enumerate(methods):
        sel = [r for r in rows if r["method"] == method]
        ai = [2 * r["stencil_points"] / (4 * (r["arrays"] + 2)) for r in sel]  # flops per ideal byte
        ax1.scatter(
            ai, [r["gpts_s"] * 2 * r["stencil_points"] for r in sel], label=method, marker="os^vDP*"[i % 7]
        )
    xs = np.logspace(-1.5, 1.5, 50)
    read_bw = head["same_memory_gbs_median"]  # the ideal traffic's rate on the cases' own buffers
    ax1.plot(xs, xs * read_bw, "k--", label=f"memory roof (median same-memory probe {read_bw:.0f} GB/s)")
    ax1.fill_between(xs, xs * head["same_memory_gbs_min"], xs * head["same_memory_gbs_max"], color="0.85",
                     label="cases' range")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("flops per ideal byte")
    ax1.set_ylabel("GFLOP/s")
    ax1.set_title("roofline (ideal traffic timed on each case's buffers)")
    ax1.legend(fontsize=7)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        vals = [
            next((r["gpts_s"] for r in rows if r["case"] == c and r["method"] == method), 0) for c in cases
        ]
        ax2.bar(np.arange(len(cases)) + i * width, vals, width, label=method)
    ax2.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, cases, rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("GPts/s")
    ax2.set_yscale("log")
    ax2.set_title("throughput per case")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
