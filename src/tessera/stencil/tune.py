"""The stencil schedules' tuner hook: the space of ``StencilSchedule``s, ranked by the stencil
model term, the shortlist compiled and timed with the operator compiler's tuner
(``kernels.tuner.measure_trial``: median of repeats, early rejection) and the choice kept
in its database (``save_choice`` / ``saved_choice``)."""

from __future__ import annotations

import itertools
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from tessera.kernels.machine import Machine, load_machine
from tessera.kernels.tuner import Trial, final_rounds, measure_trial, save_choice, saved_choice, spearman
from tessera.stencil.kernel import compile_stencil
from tessera.stencil.model import predict_stencil
from tessera.stencil.schedule import SPLIT_LEVELS, StencilSchedule
from tessera.stencil.stencil import Stencil, check_grid, factor_groups, padded_shape

TZ, TY, RY, RZ = (1, 2, 4, 8), (4, 8, 16, 32, 64), (1, 2, 4), (1, 2, 4)
MAX_JAMMED = 8  # rz x ry accumulators at most (of the 16 or 32 vector registers)
SPLITS = (2, 3, 4, 6, 8, 12)
PREFETCH = 32  # floats ahead (two AVX-512 vectors) of the prefetch twins the tuner times
STREAM = 256  # floats ahead (16 cache lines) of the streaming-prefetch twins
TWINS = 2  # of the shortlist's undecomposed vector schedules, the best this many get twins
DEEP_TY = 32  # rows of a deep twin at least (a radius-6 halo is 12 rows)
NT_TWINS = 2  # the fastest this many timed single-pass vector schedules get a non-temporal-store twin


@dataclass(frozen=True)
class Problem:
    """What the tuner's database keys a choice by."""

    stencil: Stencil
    shape: tuple[int, int, int]

    def signature(self) -> str:
        return f"stencil {self.shape} {self.stencil.signature()}"


@dataclass
class StencilTuned:
    best: StencilSchedule
    trials: list[Trial]
    space_size: int
    wall_seconds: float

    def best_of(self, decomposed: bool) -> Trial | None:
        """The fastest of that kind: by the final rounds where some of its trials were
        finalists (those are the kind's fastest of the first timing), else by the first timing."""
        done = [t for t in self.trials if t.measured is not None and t.schedule.decomposed == decomposed]
        final = [t for t in done if t.rounds]
        if final:
            return min(final, key=lambda t: statistics.median(t.rounds))
        return min(done, key=lambda t: t.measured) if done else None

    @property
    def spearman(self) -> float:
        done = [t for t in self.trials if t.measured is not None]
        return spearman([t.predicted for t in done], [t.measured for t in done])


def schedule_space(stencil: Stencil, shape, isas: tuple[str, ...]) -> list[StencilSchedule]:
    nz, ny, _ = shape
    splits = [1] + [k for k in SPLITS if stencil.variable and k <= len(stencil.points)]
    out = []
    for isa, tz, ty, ry, rz, vec, split in itertools.product(isas, TZ, TY, RY, RZ, (True, False), splits):
        if tz > nz or ty > max(ny, TY[0]) or ry > ty or rz > tz or ry * rz > MAX_JAMMED:
            continue
        if rz > 1 and (split > 1 or not vec):  # z blocks where they pay: undecomposed vector kernels (a pruning)
            continue
        levels = SPLIT_LEVELS if split > 1 else ("tile",)
        out.extend(StencilSchedule(tz=tz, ty=ty, ry=ry, rz=rz, vectorize=vec, split=split, split_level=lv, isa=isa)
                   for lv in levels)
    return out


def rank(stencil: Stencil, shape, *, threads: int, machine: Machine) -> list[Trial]:
    isas = tuple(i for i in ("avx2", "avx512") if i in machine.peak_flops)
    trials = [Trial(s, predict_stencil(stencil, shape, s, machine, threads)) for s in schedule_space(stencil, shape, isas)]
    return sorted(trials, key=lambda t: t.predicted)


def shortlist(trials: list[Trial], top_k: int) -> list[Trial]:
    """The ``top_k`` best predicted, at most one per (tile depth tz, decomposition) family (the
    model's near-ties within a family are where it is least sure, so the timed set spreads
    over tile shapes and splits), plus the best undecomposed and the best decomposed one
    when those are not among them (both are reported), the best of each vector ISA
    not among them (the model's per-ISA load costs are estimates), and the best unjammed
    vector one: the model counts the bytes a sweep moves, not how many rows it streams at
    once, and ``rz`` x ``ry`` jammed rows stream several times as many (star7: 16 rows for 2 x 2,
    6 unjammed), more than the hardware prefetchers may follow (on the Milan VM star7 constant ran
    8.15 ms under the model's 2 x 2 pick and 6.02 one row at a time, both predicted at the DRAM
    bound: benchmarks/results/amd-milan/stencil.md and its history). Where the stencil has
    decomposed schedules (variable coefficients), the best decomposed one of each vector ISA
    at each tile depth and at each split count too: the model predicts them within about 2% of
    each other (the same bytes), and the top families alone all went to one ISA and one split
    (star25 variable on the Intel VM: every one AVX2 split in two; with this rule the committed
    run 9 chose AVX-512 decomposed tiles for star25, ete37 and ete73 variable, 74.58 -> 65.73,
    106.52 -> 94.32 and 181.37 -> 174.81 ms against run 8's picks)."""
    picked, seen = [], set()
    for t in trials:
        family = (t.schedule.tz, t.schedule.split, t.schedule.split_level)
        if family not in seen:
            picked.append(t)
            seen.add(family)
        if len(picked) == top_k:
            break
    wants = [lambda s: not s.decomposed, lambda s: s.decomposed]
    wants += [lambda s, isa=isa: s.isa == isa and s.vectorize for isa in dict.fromkeys(t.schedule.isa for t in trials)]
    wants.append(lambda s: s.vectorize and not s.decomposed and s.rz == 1 and s.ry == 1)
    for isa in dict.fromkeys(t.schedule.isa for t in trials if t.schedule.decomposed):  # variable coefficients
        wants += [lambda s, isa=isa, tz=tz: s.vectorize and s.decomposed and s.isa == isa and s.tz == tz for tz in TZ]
        wants += [lambda s, isa=isa, k=k: s.vectorize and s.split == k and s.split_level == "tile" and s.isa == isa
                  for k in SPLITS]
    for want in wants:  # the best of each kind the top ones lack
        if not any(want(t.schedule) for t in picked):
            extra = next((t for t in trials if want(t.schedule)), None)
            if extra is not None:
                picked.append(extra)
    return picked


def twins(picked: list[Trial], stencil: Stencil, shape, machine: Machine, threads: int) -> list[Trial]:
    """Variants the model has no term for, of the best ``TWINS`` undecomposed vector
    schedules of the shortlist, timed beside it: with software prefetch (whether the
    hardware prefetchers keep up with a stencil's rows is measured, not predicted), and
    as deep tiles (the grid's whole depth, ``tz = nz``: each thread walks z through its
    columns, and a plane's rows, read once from memory, serve the next z steps from L2
    while the window of one step fits there; the model counts one read of the field
    either way), at least ``DEEP_TY`` rows wide so the y halo is a small part of what it
    reads. Where points share coefficients, factored twins too (``StencilSchedule.factor``:
    fewer dependent FMAs, a rounding order of its own) of those and of the best unjammed one
    (whose latency chains are longest: ete73 constant on the Milan VM, 33.1 ms jammed in the
    first committed run, 24.5 factored and unjammed in the next). And streaming-prefetch
    twins of the bases and the factored ones (``StencilSchedule.stream``: only the leading
    plane's rows and the output ahead; the committed Milan run that added them chose one for
    every constant case, star7 constant 5.96 -> 4.17 ms, star25 constant 10.93 -> 8.76). The
    best unjammed one also gets a factored twin over two planes (``rz = 2``), whose rows
    load the z neighbours they share once. And the streaming factored ones as deep tiles,
    ``DEEP_TY`` and twice as wide, where each trait alone had been timed before: the committed
    Intel run that added them (run 8) chose the 64-row one for star25 and ete37 constant,
    7.92 -> 5.08 ms and 8.56 -> 6.46 against run 7's picks."""
    undecomposed = [t.schedule for t in picked if t.schedule.vectorize and not t.schedule.decomposed
                    and not t.schedule.prefetch and not t.schedule.stream and not t.schedule.factor]
    bases = undecomposed[:TWINS]
    variants = [replace(b, prefetch=PREFETCH) for b in bases]
    variants += [replace(b, tz=shape[0], ty=max(b.ty, min(DEEP_TY, shape[1]))) for b in bases if b.tz < shape[0]]
    factored = []
    if len(factor_groups(stencil.points)) < len(stencil.points):
        unjammed = [b for b in undecomposed if b.rz == b.ry == 1][:1]
        factored = [replace(b, factor=True) for b in dict.fromkeys(bases + unjammed)]
        # two planes: a factored block loads the z neighbours the planes share once, and two
        # rows' sums are few registers beside the values held (the bases jam 8 rows)
        factored += [replace(b, factor=True, rz=2, tz=max(2, b.tz)) for b in unjammed]
    variants += factored + [replace(b, stream=STREAM) for b in dict.fromkeys(bases + factored)]
    # the factored ones with the streaming prefetch as deep tiles too, DEEP_TY and twice that
    # wide: the window of planes a column keeps in L2, the loads the factored rows share and
    # the leading plane fetched ahead, together (each alone above)
    variants += [replace(f, stream=STREAM, tz=shape[0], ty=max(f.ty, min(width, shape[1])))
                 for f in factored for width in (DEEP_TY, 2 * DEEP_TY)]
    seen = {t.schedule for t in picked}
    variants = [v for v in dict.fromkeys(variants) if v not in seen]  # two bases may share a deep twin
    return [Trial(s, predict_stencil(stencil, shape, s, machine, threads)) for s in variants]


def nt_twins(timed: list[Trial], stencil: Stencil, shape, machine: Machine, threads: int) -> list[Trial]:
    """Non-temporal-store twins (``StencilSchedule.nt``) of the ``NT_TWINS`` fastest timed
    single-pass vector schedules: whether skipping the output's read for ownership pays depends
    on whether the sweep streams from memory and how the machine combines the writes, so it is
    timed after the first timing, on the schedules that won it."""
    done = sorted((t for t in timed if t.measured is not None and t.schedule.vectorize
                   and not t.schedule.decomposed and not t.schedule.nt), key=lambda t: t.measured)
    seen = {t.schedule for t in timed}
    variants = [replace(t.schedule, nt=True) for t in done[:NT_TWINS]]
    return [Trial(v, predict_stencil(stencil, shape, v, machine, threads)) for v in variants if v not in seen]


def sample_inputs(stencil: Stencil, shape, seed: int = 0):
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(padded_shape(shape, stencil.halo), dtype=np.float32)
    coeffs = {n: 0.5 + rng.random(shape, dtype=np.float32) for n in stencil.arrays}
    return u, coeffs


def tune_stencil(stencil: Stencil, shape, *, threads: int = 1, machine: Machine | None = None, top_k: int = 4,
                 repeats: int = 5, inputs=None, extra: list[StencilSchedule] = ()) -> StencilTuned:
    """Rank the space by the model, compile and time the shortlist (and ``extra``), keep the
    fastest of the final rounds: the first timing's ``FINALISTS`` best timed again in turn
    (``kernels.tuner.final_rounds``; a memory-bound sweep's speed moves with the VM's bandwidth
    over seconds, so candidates timed one after another compare moments as much as kernels)."""
    began = time.perf_counter()
    shape = check_grid(shape)
    machine = machine or load_machine()
    trials = rank(stencil, shape, threads=threads, machine=machine)
    picked = shortlist(trials, top_k)
    picked += twins(picked, stencil, shape, machine, threads)
    picked += [Trial(s, predict_stencil(stencil, shape, s, machine, threads)) for s in extra]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # compiles only
        kernels = list(pool.map(lambda t: compile_stencil(stencil, shape, t.schedule), picked))
    inputs = inputs or sample_inputs(stencil, shape)
    best = float("inf")
    for trial, kernel in zip(picked, kernels, strict=True):
        trial.compile_seconds = kernel.compiled.compile_seconds
        measure_trial(trial, kernel, inputs, threads, repeats, best)
        best = min(best, trial.measured)
    late = nt_twins(picked, stencil, shape, machine, threads)
    for trial in late:
        kernel = compile_stencil(stencil, shape, trial.schedule)
        trial.compile_seconds = kernel.compiled.compile_seconds
        measure_trial(trial, kernel, inputs, threads, repeats, best)
        best = min(best, trial.measured)
        picked.append(trial)
        kernels.append(kernel)

    def retime(i: int, _placement: int) -> float:
        return statistics.median(kernels[i].time(*inputs, threads=threads, repeats=repeats))

    chosen = final_rounds(picked, retime).schedule
    save_choice(Problem(stencil, shape), threads, machine, chosen)
    return StencilTuned(chosen, picked, len(trials), time.perf_counter() - began)


def best_stencil_schedule(stencil: Stencil, shape, *, threads: int = 1, machine: Machine | None = None) -> StencilSchedule:
    """The recorded choice, else the model's first."""
    shape = check_grid(shape)
    machine = machine or load_machine()
    entry = saved_choice(Problem(stencil, shape), threads, machine)
    if entry is not None:
        return StencilSchedule.from_dict(entry["schedule"])
    return rank(stencil, shape, threads=threads, machine=machine)[0].schedule
