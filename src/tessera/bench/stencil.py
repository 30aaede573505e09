"""`tessera bench stencil`: Tessera's stencil kernels (issue 14) against the memory roofline,
numpy slicing, torch conv3d (constant coefficients) and Devito on the same equation.

For star-7, star-25, ete37 and ete73, each with constant and with variable coefficients (one
3-D array per offset), on an N^3 interior: the tuner's best schedule, its best undecomposed
and best decomposed one (reported apart), in GPts/s and as a fraction of the memory
roofline: the ideal bytes per point (each coefficient array and the field read once, the
output written once) over the DRAM read and write bandwidth the machine benchmark measures
at the start of this run. Plus the wave kernel with and without temporal blocking.

Devito runs in its own venv (.cache/devito-venv; it pins numpy below Tessera's), installed
by the full run when missing; opt='advanced', autotuning='aggressive', DEVITO_LANGUAGE=openmp
and OMP_NUM_THREADS = the threads Tessera uses. Its time is its own operator timer (the C
sections, no Python call overhead) per sweep, the more favourable of its two figures.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.bench.harness import BenchResult
from tessera.bench.stencil_peers import ensure_devito, numpy_stencil, run_devito, timed, torch_conv3d


@dataclass(frozen=True, kw_only=True)
class StencilPlan:
    grid: int
    shapes: tuple[str, ...]
    kinds: tuple[str, ...] = ("constant", "point")
    repeats: int
    top_k: int
    threads: int = 2
    devito: bool
    install_devito: bool
    wave_grid: int
    wave_steps: int


FULL = StencilPlan(
    grid=256,
    shapes=("star7", "star25", "ete37", "ete73"),
    repeats=3,
    top_k=4,
    devito=True,
    install_devito=True,
    wave_grid=256,
    wave_steps=8,
)
QUICK = StencilPlan(
    grid=40,
    shapes=("star7", "ete37"),
    repeats=3,
    top_k=2,
    devito=True,
    install_devito=False,
    wave_grid=40,
    wave_steps=4,
)


# ---- one case ---------------------------------------------------------------------------------


def _roofline(st, points: int, bw: dict) -> float:
    from tessera.stencil.model import roofline_bytes

    read, write = roofline_bytes(st)
    return points * (read / bw["read"] + write / bw["write"])


def _row(case: str, method: str, seconds: float, grid_points: int, roof: float, **extra) -> dict:
    return {
        "case": case,
        "method": method,
        "ms": seconds * 1e3,
        "gpts_s": grid_points / seconds / 1e9,
        "roofline_fraction": roof / seconds,
        **extra,
    }


def _local_rows(plan: StencilPlan, st, case: str, kind: str, machine, bw: dict) -> list[dict]:
    """Tessera (tuned; best, best undecomposed, best decomposed), numpy and torch: the arrays
    live only in here, so they are freed before Devito allocates its own."""
    from tessera.stencil import compile_stencil
    from tessera.stencil.tune import sample_inputs, tune_stencil

    grid = (plan.grid,) * 3
    points = math.prod(grid)
    u, coeffs = sample_inputs(st, grid)
    roof = _roofline(st, points, bw)
    tuned = tune_stencil(
        st,
        grid,
        threads=plan.threads,
        machine=machine,
        top_k=plan.top_k,
        repeats=plan.repeats,
        inputs=(u, coeffs),
    )
    ours = compile_stencil(st, grid, tuned.best)(u, coeffs, threads=plan.threads)
    base = {"arrays": len(st.arrays), "stencil_points": len(st.points), "roofline_ms": roof * 1e3}
    best = min((t for t in tuned.trials if t.measured), key=lambda t: t.measured)
    rows = []
    for label, trial in (
        ("tessera", best),
        ("tessera undecomposed", tuned.best_of(False)),
        ("tessera decomposed", tuned.best_of(True)),
    ):
        if trial is not None:
            rows.append(
                _row(
                    case,
                    label,
                    trial.measured,
                    points,
                    roof,
                    schedule=trial.schedule.short(),
                    predicted_ms=trial.predicted * 1e3,
                    **base,
                )
            )
    rows[0]["model_spearman"] = tuned.spearman
    out, tmp = np.zeros_like(u), np.empty(grid, np.float32)
    times = timed(lambda: numpy_stencil(st, u, coeffs, out, tmp), 1)
    scale = float(np.abs(out).max())
    rows.append(
        _row(
            case,
            "numpy (1 thread)",
            min(times),
            points,
            roof,
            max_rel_diff=float(np.abs(out - ours).max()) / scale,
            **base,
        )
    )
    if kind == "constant":
        times, conv = torch_conv3d(
            st, u, plan.threads, min(plan.repeats, 2)
        )  # its direct conv: seconds a call
        h = st.halo
        rows.append(
            _row(
                case,
                "torch conv3d",
                statistics.median(times),
                points,
                roof,
                max_rel_diff=float(np.abs(conv - ours[h:-h, h:-h, h:-h]).max()) / scale,
                **base,
            )
        )
    return rows


def run_case(plan: StencilPlan, shape_name: str, kind: str, machine, bw: dict, devito_ok: bool) -> list[dict]:
    from tessera.stencil import make_stencil

    st = make_stencil(shape_name, kind)
    case = f"{shape_name} {'variable' if kind == 'point' else kind}"
    rows = _local_rows(plan, st, case, kind, machine, bw)
    if devito_ok:
        grid = (plan.grid,) * 3
        res = run_devito(st, shape_name, grid, plan.threads, plan.repeats)
        if "error" in res:
            rows.append({"case": case, "method": "devito", "error": res["error"]})
        else:
            rows.append(
                _row(
                    case,
                    "devito",
                    statistics.median(res["kernel_seconds"]),
                    math.prod(grid),
                    _roofline(st, math.prod(grid), bw),
                    wall_ms=statistics.median(res["wall_seconds"]) * 1e3,
                    check_ok=res["check_ok"],
                    setup_s=res["setup_seconds"],
                    arrays=len(st.arrays),
                    stencil_points=len(st.points),
                )
            )
    return rows


def run_wave_rows(plan: StencilPlan, bw: dict) -> list[dict]:
    """The wave kernel (ete37, constant medium) with and without temporal blocking."""
    from tessera.stencil import StencilSchedule, compile_wave, padded_shape
    from tessera.stencil.wave import WaveConfig, wave_stencil

    grid = (plan.wave_grid,) * 3
    cfg = WaveConfig(shape="ete37", grid=grid, velocity="constant", steps=plan.wave_steps)
    st, coeffs = wave_stencil(cfg)
    rng = np.random.default_rng(0)
    prev = rng.standard_normal(padded_shape(grid, st.halo), dtype=np.float32) * 1e-3
    cur = prev.copy()
    src = np.zeros(plan.wave_steps, np.float32)
    roof = math.prod(grid) * (8 / bw["read"] + 4 / bw["write"])  # one step: two fields read, one written
    rows = []
    for tb in (1, 2, 4):
        kernel = compile_wave(st, grid, StencilSchedule(time_block=tb, isa=_isa()))
        times = timed(
            lambda k=kernel: k.run(prev, cur, coeffs, src, (1, 1, 1), threads=plan.threads), plan.repeats
        )
        per_step = statistics.median(times) / plan.wave_steps
        rows.append(
            _row(
                f"wave ete37 constant {plan.wave_steps} steps",
                f"tessera time_block={tb}",
                per_step,
                math.prod(grid),
                roof,
                roofline_ms=roof * 1e3,
            )
        )
    return rows


def _isa() -> str:
    from tessera.kernels.machine import cpu_isas

    return cpu_isas()[-1]


# ---- the run, its headline and figure -----------------------------------------------------------


def _headline(rows: list[dict], bw: dict, threads: int, devito_note: str) -> dict:
    ours = {r["case"]: r for r in rows if r["method"] == "tessera"}
    var = [r["roofline_fraction"] for c, r in ours.items() if "variable" in c]
    const = [r["roofline_fraction"] for c, r in ours.items() if "constant" in c and not c.startswith("wave")]
    ratios = {
        r["case"]: ours[r["case"]]["gpts_s"] / r["gpts_s"]
        for r in rows
        if r["method"] == "devito" and "gpts_s" in r and r["case"] in ours
    }
    head = {
        "threads": threads,
        "dram_read_gbs": round(bw["read"] / 1e9, 2),
        "dram_read_one_stream_gbs": round(bw.get("one_stream", bw["read"]) / 1e9, 2),
        "dram_write_gbs": round(bw["write"] / 1e9, 2),
        "roofline_fraction_variable_min": round(min(var), 3) if var else None,
        "roofline_fraction_variable_max": round(max(var), 3) if var else None,
        "roofline_fraction_constant_min": round(min(const), 3) if const else None,
        "roofline_fraction_constant_max": round(max(const), 3) if const else None,
        "speed_vs_devito_geomean": round(math.exp(statistics.fmean(math.log(x) for x in ratios.values())), 3)
        if ratios
        else None,
        "speed_vs_devito_min": round(min(ratios.values()), 3) if ratios else None,
        "devito": devito_note,
    }
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


def run_stencil_bench(quick: bool = False) -> BenchResult:
    from tessera.kernels.machine import dram_bandwidth, dram_streams_read_bandwidth, load_machine

    plan = QUICK if quick else FULL
    machine = load_machine()
    one_stream, write = dram_bandwidth(plan.threads)
    # the roofline is the best read rate this machine attains: a kernel reading one array
    # per stencil point keeps more misses in flight than one stream does
    by_streams = dram_streams_read_bandwidth(plan.threads)
    read = max(one_stream, *by_streams.values())
    bw = {"read": read, "write": write, "one_stream": one_stream}
    why_not = ensure_devito(plan.install_devito) if plan.devito else "skipped"
    rows = []
    for shape_name in plan.shapes:
        for kind in plan.kinds:
            rows += run_case(plan, shape_name, kind, machine, bw, why_not is None)
    rows += run_wave_rows(plan, bw)
    devito_note = "devito 4.8.23 (own venv)" if why_not is None else f"absent: {why_not}"
    notes = [
        f"{plan.threads} threads for Tessera, torch and Devito (OMP_NUM_THREADS={plan.threads}, DEVITO_LANGUAGE=openmp,"
        " opt='advanced', autotuning='aggressive'); numpy is single-threaded.",
        f"grid {plan.grid}^3 interior, float32; variable = one coefficient array per offset; roofline = ideal bytes "
        f"per point over this run's measured DRAM bandwidth (read {read / 1e9:.1f} GB/s, the best of one stream "
        f"{one_stream / 1e9:.1f} and of k streams at once "
        + ", ".join(f"k={k} {v / 1e9:.1f}" for k, v in by_streams.items())
        + f"; write {write / 1e9:.1f} GB/s; {plan.threads} threads).",
        "Tessera's time: median of the tuner's timed runs of the schedule; Devito's: its own operator timer per sweep "
        "(a 4-step time loop, as its autotuner needs one); its answer checked on a 9x10x23 grid against float64.",
        f"Devito: {devito_note}.",
    ]
    columns = [
        "case",
        "method",
        "ms",
        "gpts_s",
        "roofline_fraction",
        "schedule",
        "predicted_ms",
        "max_rel_diff",
        "check_ok",
    ]
    return BenchResult(
        name="stencil",
        headline=_headline(rows, bw, plan.threads, devito_note),
        rows=rows,
        columns=columns,
        notes=notes,
        extra={"plan": plan.__dict__},
    )


def plot_stencil(result: BenchResult, path: Path) -> None:
    """Left: the memory roofline (measured bandwidth) with each case's GFLOP/s by method.
    Right: GPts/s per case and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows if "gpts_s" in r and not r["case"].startswith("wave")]
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
    read_bw = head["dram_read_gbs"]  # a stencil's bytes are nearly all reads: the read roof bounds it
    ax1.plot(xs, xs * read_bw, "k--", label=f"DRAM read roof ({read_bw:.0f} GB/s)")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("flops per ideal byte")
    ax1.set_ylabel("GFLOP/s")
    ax1.set_title("roofline (measured DRAM bandwidth)")
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
