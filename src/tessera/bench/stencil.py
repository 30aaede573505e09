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

import numpy as np

from tessera.bench.harness import BenchResult
from tessera.bench.stencil_peers import ensure_devito, numpy_stencil, run_devito, timed, torch_conv3d
from tessera.bench.stencil_report import headline, notes, plot_stencil
from tessera.bench.stencil_roofline import (
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
                setup_s=res["setup_seconds"], code_path=res.get("code_path", ""), arrays=len(st.arrays),
                stencil_points=len(st.points),
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


def run_large_rows(plan: StencilPlan, machine, log: BandwidthLog) -> tuple[list[dict], list[str]]:
    """Tessera alone on a ``large_grid``^3 interior, for each case whose arrays (field,
    output and coefficients) fit in ``large_memory_fraction`` of the memory available now;
    the others are named as skipped."""
    from tessera.kernels.machine import available_memory_bytes
    from tessera.stencil import make_stencil, padded_shape
    from tessera.stencil.tune import sample_inputs

    grid = (plan.large_grid,) * 3
    rows, skipped = [], []
    for shape_name in plan.shapes:
        for kind in plan.kinds:
            st = make_stencil(shape_name, kind)
            need = 4 * (len(st.arrays) * math.prod(grid) + 2 * math.prod(padded_shape(grid, st.halo)))
            budget = plan.large_memory_fraction * available_memory_bytes()
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


# ---- the run ----------------------------------------------------------------------------------


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
        headline=headline(rows, sweep, log, plan, devito_note),
        rows=rows,
        columns=columns,
        notes=notes(plan, sweep, log, devito_note, skipped),
        extra={"plan": plan.__dict__, "bandwidth_probes_gbs": [[round(r / 1e9, 2), round(w / 1e9, 2)]
                                                                for r, w in log.samples]},
    )


__all__ = ["FULL", "QUICK", "StencilPlan", "plot_stencil", "run_stencil_bench"]
