"""`tessera bench stencil`: Tessera's stencil kernels (issue 14) against the memory roofline,
numpy slicing, torch conv3d (constant coefficients) and Devito on the same equation.

For star-7, star-25, ete37 and ete73, each with constant and with variable coefficients (one
3-D array per offset), on an N^3 interior: the tuner's best schedule, its best undecomposed
and best decomposed one (reported apart), in GPts/s and as a fraction of the memory
roofline: the ideal bytes per point (each coefficient array and the field read once, the
output written once) timed on the sweep's own buffers right before and after each timed
sweep (``stencil_roofline``: this VM's bandwidth moves in time, so a figure from the start
of the run would not repeat). Plus the wave kernel with and without
temporal blocking, and Tessera alone on a larger grid for the cases that fit in memory.

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
from tessera.bench.stencil_roofline import (
    PROBE_GROUP,
    BandwidthLog,
    ideal_bytes,
    same_memory_probe,
    sandwiched,
)


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
    rounds: int  # timed sweeps of each kernel compared, each between two roofline probes
    large_grid: int = 0  # 0: no larger grid
    large_memory_fraction: float = 0.45  # of MemAvailable, for one large case's arrays
    stream_bytes: int | None = None  # the STREAM probe's three arrays together (None: 1 GiB or 32x the LLC)


FULL = StencilPlan(
    grid=256,
    shapes=("star7", "star25", "ete37", "ete73"),
    repeats=3,
    top_k=4,
    devito=True,
    install_devito=True,
    wave_grid=256,
    wave_steps=8,
    rounds=7,
    large_grid=384,
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
    rounds=2,
    large_grid=48,
    stream_bytes=96 << 20,  # a plumbing check: still past this machine's last-level cache
)


# ---- one case ---------------------------------------------------------------------------------


def _row(case: str, method: str, seconds: float, grid_points: int, roof: float, **extra) -> dict:
    return {
        "case": case,
        "method": method,
        "ms": seconds * 1e3,
        "gpts_s": grid_points / seconds / 1e9,
        "roofline_fraction": roof / seconds,
        **extra,
    }


def _tessera_rows(plan: StencilPlan, st, case: str, grid, machine, log: BandwidthLog, inputs, top_k: int,
                  repeats: int, rounds: int) -> tuple[list[dict], float, np.ndarray, object]:
    """The tuner's best undecomposed and best decomposed schedules, each sweep timed between
    two roofline probes on the same buffers; the faster is the "tessera" row. Returns the
    rows, the median probe (the roofline seconds), Tessera's answer and its kernel."""
    from tessera.stencil import compile_stencil
    from tessera.stencil.model import incore_seconds
    from tessera.stencil.tune import tune_stencil

    points = math.prod(grid)
    u, coeffs = inputs
    log.probe()  # the machine's drift, reported beside the run
    tuned = tune_stencil(st, grid, threads=plan.threads, machine=machine, top_k=top_k, repeats=repeats,
                         inputs=inputs)
    picks = {label: t for label, t in (("tessera undecomposed", tuned.best_of(False)),
                                       ("tessera decomposed", tuned.best_of(True))) if t is not None}
    kernels = {label: compile_stencil(st, grid, t.schedule) for label, t in picks.items()}
    out = np.zeros_like(u)
    runs = {label: (lambda k=k: k(u, coeffs, out=out, threads=plan.threads)) for label, k in kernels.items()}
    probe = same_memory_probe(out, [u, *(coeffs[n] for n in st.arrays)], points, plan.threads)
    got = sandwiched(runs, probe, rounds)
    roof = next(iter(got.values())).roof_seconds
    base = {"arrays": len(st.arrays), "stencil_points": len(st.points), "grid": grid[0]}
    rows = []
    for label, trial in picks.items():
        row = _row(case, label, got[label].seconds, points, roof, schedule=trial.schedule.short(),
                   predicted_ms=trial.predicted * 1e3, tuner_ms=trial.measured * 1e3, **base)
        incore = incore_seconds(st, grid, trial.schedule, machine, plan.threads)
        # the lower of the two bounds on speed: the longer of the DRAM (own-buffer probe) and in-core times
        row |= {"incore_ms": incore * 1e3, "bound_fraction": max(roof, incore) / got[label].seconds,
                "bound": "in-core" if incore > roof else "DRAM"}  # fmt: skip
        rows.append({**row, **got[label].fields(ideal_bytes(st, points))})
    fastest = min(rows, key=lambda r: r["ms"])
    kernel = kernels[fastest["method"]]
    ours = kernel(u, coeffs, threads=plan.threads)
    return [dict(fastest, method="tessera", model_spearman=tuned.spearman), *rows], roof, ours, kernel


def _local_rows(plan: StencilPlan, st, case: str, kind: str, machine, log: BandwidthLog) -> tuple[list[dict], float,
                                                                                                 object]:
    """Tessera, numpy and torch: the arrays live only in here, so they are freed before
    Devito allocates its own."""
    from tessera.stencil.tune import sample_inputs

    grid = (plan.grid,) * 3
    points = math.prod(grid)
    u, coeffs = sample_inputs(st, grid)
    rows, roof, ours, kernel = _tessera_rows(plan, st, case, grid, machine, log, (u, coeffs), plan.top_k, plan.repeats,
                                     plan.rounds)
    base = {"arrays": len(st.arrays), "stencil_points": len(st.points), "roofline_ms": roof * 1e3}
    out, tmp = np.zeros_like(u), np.empty(grid, np.float32)
    times = timed(lambda: numpy_stencil(st, u, coeffs, out, tmp), 1)
    scale = float(np.abs(out).max())
    rows.append(_row(case, "numpy (1 thread)", min(times), points, roof,
                     max_rel_diff=float(np.abs(out - ours).max()) / scale, **base))
    if kind == "constant":
        times, conv = torch_conv3d(st, u, plan.threads, min(plan.repeats, 2))  # its direct conv: seconds a call
        h = st.halo
        rows.append(_row(case, "torch conv3d", statistics.median(times), points, roof,
                         max_rel_diff=float(np.abs(conv - ours[h:-h, h:-h, h:-h]).max()) / scale, **base))
    return rows, roof, kernel


def _devito_row(plan: StencilPlan, st, shape_name: str, case: str, roof: float, kernel) -> dict:
    """Devito and Tessera's ``kernel`` each in a process of its own on bit-identical arrays,
    ``plan.rounds`` rounds interleaved. ``vs_tessera``: the paired ratio (median of Devito's
    sweep / Tessera's, round by round, range in ``vs_tessera_min/max``); ``vs_tessera_unpaired``:
    median over median, its range the extremes' ratios. The fraction is Devito's time against
    Tessera's median probe for the case (minutes apart, so less sure than the pairs)."""
    grid = (plan.grid,) * 3
    res = run_devito(st, shape_name, grid, plan.threads, plan.rounds, tessera={"lib": str(kernel.compiled.path)})
    if "error" in res:
        return {"case": case, "method": "devito", "error": res["error"]}
    dev, ours = res["kernel_seconds"], res["tessera_seconds"]
    pairs = [d / t for d, t in zip(dev, ours, strict=True)]
    return _row(case, "devito", statistics.median(dev), math.prod(grid), roof,
                wall_ms=statistics.median(res["wall_seconds"]) * 1e3, check_ok=res["check_ok"],
                setup_s=res["setup_seconds"], arrays=len(st.arrays), stencil_points=len(st.points),
                tessera_paired_ms=statistics.median(ours) * 1e3, rounds=len(pairs),
                vs_tessera=statistics.median(pairs), vs_tessera_min=round(min(pairs), 4),
                vs_tessera_max=round(max(pairs), 4),
                vs_tessera_unpaired=statistics.median(dev) / statistics.median(ours),
                vs_tessera_unpaired_min=round(min(dev) / max(ours), 4),
                vs_tessera_unpaired_max=round(max(dev) / min(ours), 4))  # fmt: skip


def _case_name(shape_name: str, kind: str) -> str:
    return f"{shape_name} {'variable' if kind == 'point' else kind}"


def run_case(plan: StencilPlan, shape_name: str, kind: str, machine, log: BandwidthLog, devito_ok: bool) -> list[dict]:
    from tessera.stencil import make_stencil

    st = make_stencil(shape_name, kind)
    case = _case_name(shape_name, kind)
    before = log.stream()
    rows, roof, kernel = _local_rows(plan, st, case, kind, machine, log)
    if devito_ok:
        rows.append(_devito_row(plan, st, shape_name, case, roof, kernel))
    stream = (before + log.stream()) / 2  # the STREAM roofline around the case
    ideal = ideal_bytes(st, plan.grid**3)
    for row in rows:
        if "ms" in row:
            row["stream_gbs"] = round(stream / 1e9, 2)
            row["stream_fraction"] = ideal / (row["ms"] / 1e3) / stream
    return rows


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_large_rows(plan: StencilPlan, machine, log: BandwidthLog) -> tuple[list[dict], list[str]]:
    """Tessera alone on a ``large_grid``^3 interior, for each case whose arrays (field,
    output and coefficients) fit in ``large_memory_fraction`` of the memory available now;
    the others are named as skipped."""
    from tessera.stencil import make_stencil, padded_shape
    from tessera.stencil.tune import sample_inputs

    grid = (plan.large_grid,) * 3
    rows, skipped = [], []
    for shape_name in plan.shapes:
        for kind in plan.kinds:
            st = make_stencil(shape_name, kind)
            need = 4 * (len(st.arrays) * math.prod(grid) + 2 * math.prod(padded_shape(grid, st.halo)))
            budget = plan.large_memory_fraction * _available_bytes()
            case = f"{_case_name(shape_name, kind)} {plan.large_grid}^3"
            if need > budget:
                skipped.append(f"{case} ({need / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB)")
                continue
            got, _, _, _ = _tessera_rows(plan, st, case, grid, machine, log, sample_inputs(st, grid), 2, 2,
                                      max(2, plan.rounds - 4))
            rows.append(got[0])
    return rows, skipped


def run_wave_rows(plan: StencilPlan, log: BandwidthLog) -> list[dict]:
    """The wave kernel (ete37, constant medium) with and without temporal blocking; each run
    of all steps between two probes of one step's ideal traffic (two fields read, one
    written) on the wave's own fields."""
    from tessera.stencil import StencilSchedule, compile_wave, padded_shape
    from tessera.stencil.wave import WaveConfig, wave_stencil

    grid = (plan.wave_grid,) * 3
    points = math.prod(grid)
    cfg = WaveConfig(shape="ete37", grid=grid, velocity="constant", steps=plan.wave_steps)
    st, coeffs = wave_stencil(cfg)
    rng = np.random.default_rng(0)
    prev = rng.standard_normal(padded_shape(grid, st.halo), dtype=np.float32) * 1e-3
    cur, scratch = prev.copy(), np.zeros_like(prev)
    src = np.zeros(plan.wave_steps, np.float32)
    runs = {}
    for tb in (1, 2, 4):
        kernel = compile_wave(st, grid, StencilSchedule(time_block=tb, isa=_isa()))
        runs[f"tessera time_block={tb}"] = lambda k=kernel: k.run(prev, cur, coeffs, src, (1, 1, 1),
                                                                   threads=plan.threads)
    log.probe()
    got = sandwiched(runs, same_memory_probe(scratch, [prev, cur], points, plan.threads), plan.rounds,
                     scale=plan.wave_steps)
    case = f"wave ete37 constant {plan.wave_steps} steps"
    rows = []
    for label, g in got.items():
        step_roof = g.roof_seconds / plan.wave_steps
        row = _row(case, label, g.seconds / plan.wave_steps, points, step_roof)
        rows.append({**row, **g.fields(12 * points * plan.wave_steps), "roofline_ms": step_roof * 1e3})
    return rows


def _isa() -> str:
    from tessera.kernels.machine import cpu_isas

    return cpu_isas()[-1]


# ---- the run, its headline and figure -----------------------------------------------------------


def _fractions(ours: dict, word: str) -> dict:
    got = [r["roofline_fraction"] for c, r in ours.items() if word in c]
    return {"min": round(min(got), 3), "max": round(max(got), 3)} if got else {"min": None, "max": None}


def _geomean(values: list[float]) -> float | None:
    return round(math.exp(statistics.fmean(math.log(x) for x in values)), 3) if values else None


def _stream_fractions(ours: dict, word: str) -> dict:
    got = [r["stream_fraction"] for c, r in ours.items() if word in c and "stream_fraction" in r]
    return {"min": round(min(got), 3), "max": round(max(got), 3)} if got else {"min": None, "max": None}


def _headline(rows: list[dict], sweep: dict, log: BandwidthLog, plan: StencilPlan, devito_note: str) -> dict:
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
           for end, v in _stream_fractions(ours, word).items()},  # fmt: skip
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


def _notes(plan: StencilPlan, sweep: dict, log: BandwidthLog, devito_note: str, skipped: list[str]) -> list[str]:
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


def run_stencil_bench(quick: bool = False) -> BenchResult:
    from tessera.kernels.machine import dram_bandwidth, dram_streams_read_bandwidth, load_machine

    plan = QUICK if quick else FULL
    machine = load_machine()
    one_stream, write = dram_bandwidth(plan.threads)
    by_streams = dram_streams_read_bandwidth(plan.threads)
    sweep = {"read": max(one_stream, *by_streams.values()), "write": write, "one_stream": one_stream,
             "by_streams": by_streams}
    log = BandwidthLog(plan.threads, stream_bytes=plan.stream_bytes)
    why_not = ensure_devito(plan.install_devito) if plan.devito else "skipped"
    rows = []
    for shape_name in plan.shapes:
        for kind in plan.kinds:
            rows += run_case(plan, shape_name, kind, machine, log, why_not is None)
    rows += run_wave_rows(plan, log)
    skipped = []
    if plan.large_grid:
        large, skipped = run_large_rows(plan, machine, log)
        rows += large
    devito_note = "devito 4.8.23 (own venv)" if why_not is None else f"absent: {why_not}"
    columns = ["case", "method", "ms", "gpts_s", "roofline_fraction", "fraction_min", "fraction_max",
               "same_memory_gbs", "stream_fraction", "stream_gbs", "incore_ms", "bound_fraction", "bound", "vs_tessera", "schedule", "predicted_ms", "max_rel_diff", "check_ok"]
    return BenchResult(
        name="stencil",
        headline=_headline(rows, sweep, log, plan, devito_note),
        rows=rows,
        columns=columns,
        notes=_notes(plan, sweep, log, devito_note, skipped),
        extra={"plan": plan.__dict__, "bandwidth_probes_gbs": [[round(r / 1e9, 2), round(w / 1e9, 2)]
                                                                for r, w in log.samples]},
    )


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
