"""Model-guided tuning (swATOP's split): the analytic model ranks the whole schedule space,
only a handful of the best predicted are compiled and timed (median of repeats), and the
fastest is kept in a small on-disk database keyed by the operator, the thread count and
the machine's fingerprint. Without measuring (``mode="model"``) the model's first choice
is used as is."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tessera.kernels.codegen_gemm import b_bytes, effective_packing, packs_b_by_first_tile
from tessera.kernels.compiler import cache_dir
from tessera.kernels.ir import Operator
from tessera.kernels.kernel import aligned_normal, compile_kernel
from tessera.kernels.machine import Machine, load_machine
from tessera.kernels.model import predict
from tessera.kernels.schedule import GemmSchedule, Schedule, schedule_from_dict
from tessera.kernels.space import schedule_space
from tessera.kernels.winograd import winograd_space

MODES = ("model", "measure")


@dataclass
class Trial:
    schedule: Schedule
    predicted: float
    measured: float | None = None
    times: list[float] = field(default_factory=list)
    compile_seconds: float = 0.0
    rounds: list[float] = field(default_factory=list)  # a finalist's interleaved re-timings (tune)
    # its first run was far slower than the best so far (timed no further), or its prediction
    # was (SKIP_FACTOR: not timed at all, measured None)
    rejected: bool = False


@dataclass
class Tuned:
    op: Operator
    threads: int
    best: Schedule
    trials: list[Trial]
    space_size: int
    model_seconds: float
    compile_seconds: float
    measure_seconds: float
    wall_seconds: float

    @property
    def best_seconds(self) -> float:
        return min(t.measured for t in self.trials if t.measured is not None)

    @property
    def spearman(self) -> float:
        done = [t for t in self.trials if t.measured is not None]
        return spearman([t.predicted for t in done], [t.measured for t in done])


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (ties get their average rank); nan for fewer than 3 pairs."""
    if len(x) != len(y) or len(x) < 3:
        return float("nan")
    rx, ry = _ranks(list(x)), _ranks(list(y))
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def rank(op: Operator, *, threads: int, machine: Machine) -> list[Trial]:
    """Every schedule of the space with its predicted time, fastest first."""
    isas = tuple(i for i in ("avx2", "avx512") if i in machine.peak_flops)
    space = schedule_space(op, threads=threads, isas=isas) + winograd_space(op, threads=threads, isas=isas,
                                                                             machine=machine)
    trials = [Trial(s, predict(op, s, machine, threads)) for s in space]
    if not trials:
        raise ValueError(f"{op.name}: no schedule in the space (ISAs {isas})")
    return sorted(trials, key=lambda t: t.predicted)


def _family(s: Schedule) -> tuple:
    if isinstance(s, GemmSchedule):
        return (s.isa, s.mr, s.nr)
    if s.kind == "direct":
        return (s.kind, s.algo, s.isa)
    return (s.kind, s.m) if s.kind == "winograd" else (s.kind,)  # F(2) and F(4) are two algorithms


def shortlist(trials: list[Trial], top_k: int, per_family: int = 2) -> list[Trial]:
    """The ``top_k`` best predicted, at most ``per_family`` of one register tile (the model's
    near-ties within a tile are where it is least sure, so the timed set spreads over tiles),
    plus the best of the other lowering (micro-kernel vs loops), and the AMX GEMM at a second
    row block where it is picked."""
    picked, count = [], {}
    for t in trials:
        fam = _family(t.schedule)
        if count.get(fam, 0) < per_family:
            picked.append(t)
            count[fam] = count.get(fam, 0) + 1
        if len(picked) == top_k:
            break
    kinds = {_lowering(t.schedule) for t in picked}
    for t in trials[top_k:]:
        if _lowering(t.schedule) not in kinds:
            picked.append(t)
            kinds.add(_lowering(t.schedule))
    # the AMX GEMM at a second row block, wherever one is picked: the model does not rank its row
    # blocks reliably, least for a batch or a convolution, where all of A's rows in one block (B
    # split once a call) meet blocks that keep A's block in L2 (B split once a block; 8x 1x1
    # c256->1024 14x14 on 1 thread: 173 GFLOP/s at 256 rows, 138 at 1024; on 2 threads 231 and
    # 220); one more timing a shape
    amx_rows = {t.schedule.rows for t in picked if getattr(t.schedule, "algo", None) == "amx"}
    if amx_rows:
        other = next((t for t in trials if getattr(t.schedule, "algo", None) == "amx" and t.schedule.rows not in amx_rows),
                     None)
        if other is not None:
            picked.append(other)
    # an operand read straight from its matrix is where the model is least sure (cache sets,
    # lines split by an odd row stride: 129x3071x767 was predicted at 210 GFLOP/s and ran at
    # 80-93, B unpacked; 128x768x3072's twelve best predicted all read B in place and ran at
    # 98-142 against 158 for the best that packs both): for each register tile picked only
    # with an operand unpacked, its best-ranked schedule that packs both is timed too
    tiles = {}
    for t in picked:
        if isinstance(t.schedule, GemmSchedule):
            tiles[_family(t.schedule)] = tiles.get(_family(t.schedule), False) or _packs_both(t.schedule)
    for fam in [f for f, both in tiles.items() if not both]:
        both = next((t for t in trials if isinstance(t.schedule, GemmSchedule) and _family(t.schedule) == fam
                     and _packs_both(t.schedule)), None)
        if both is not None:
            picked.append(both)
    return picked


PREFETCH_B_ROWS = 12  # rows of B ahead, in the prefetch twins (8-16 ran alike on 1x1 convolutions)
PREFETCH_TWINS_OF_PACKED = 2  # the best predicted this many schedules that pack B get a twin too


def prefetch_twins(op: Operator, picked: list[Trial], machine: Machine, threads: int) -> list[Trial]:
    """Twins timed beside the shortlist, reading B in place with its rows prefetched ahead
    (``prefetch_b``): of every GEMM schedule picked that reads B in place, and of the best
    predicted ``PREFETCH_TWINS_OF_PACKED`` that pack a B they could read in place; those two also
    get a twin that packs each B panel in its first row tile (``pack_b_first_tile``). The model
    has no term for whether the hardware prefetchers follow B's rows (each a short run on a page
    of its own: they do not), nor for a copy overlapped with arithmetic, so both are measured (n1
    c256->64 56x56 1x1: packing B 138 GFLOP/s, in place 143, in place with prefetch 159;
    128x3072x768: packing B first 159, in each panel's first tile 176, but 2048^3 0.97x).
    Where B is larger than L2, each twin has a twin of its own that fetches the next B panel
    spread over this panel's row tiles (``prefetch_next_b``): the first tile alone streams the
    panel past one core's memory bandwidth (n8 c256->128 56x56 1x1: 130 -> 164 GFLOP/s packing
    in the first tile; 128x3072x768 161 -> 152: so it is timed, not assumed)."""
    seen = {t.schedule for t in picked}
    twins, of_packed = [], 0
    # B from beyond L2 (read once a call, as a layer's weight or a batch of images is): its next
    # panel can be fetched while this one computes (prefetch_next_b)
    streams_b = any(isinstance(t.schedule, GemmSchedule) for t in picked) and b_streams(op, machine)
    for t in picked:
        s = t.schedule
        if not isinstance(s, GemmSchedule) or s.prefetch_b or s.pack_b_first_tile or s.prefetch_next_b:
            continue  # a twin already (the streaming nest's fused one)
        in_place = not effective_packing(op, s)[1]
        if not in_place:
            if of_packed == PREFETCH_TWINS_OF_PACKED:
                continue
            s = dataclasses.replace(s, pack_b=False)
            if effective_packing(op, s)[1]:  # B is not a plain strided matrix: always packed
                continue
            of_packed += 1
        candidates = [dataclasses.replace(s, prefetch_b=PREFETCH_B_ROWS)]
        if not in_place:  # and the packing schedule packing each panel in its first tile
            fused = first_tile_packing(op, t.schedule)
            if fused is not None:
                candidates.append(fused)
        if streams_b and s.inner == "jr,ir":  # each also fetching its next B panel on the way
            candidates += [dataclasses.replace(c, prefetch_next_b=True) for c in list(candidates)]
        for twin in candidates:
            if twin not in seen:
                seen.add(twin)
                twins.append(Trial(twin, predict(op, twin, machine, threads)))
    return twins


def first_tile_packing(op: Operator, s: GemmSchedule) -> GemmSchedule | None:
    """``s`` packing each B panel in its first row tile (``pack_b_first_tile``; B packed, not
    read in place), or None where B cannot be packed that way."""
    fused = s.packing_b(first_tile=True)
    return fused if packs_b_by_first_tile(op, fused) else None


def b_streams(op: Operator, machine: Machine) -> bool:
    """Whether the contraction's B is larger than a core's share of L2 (read from beyond it)."""
    return b_bytes(op) > machine.cache_bytes.get("L2", 1 << 20) / machine.cache_shared_by.get("L2", 1)


def streaming_nest(op: Operator, trials: list[Trial], picked: list[Trial], machine: Machine, threads: int) -> list[Trial]:
    """Where B streams from beyond L2 and no GEMM schedule picked holds a B panel across its row
    tiles (inner ``jr,ir``), the best ranked schedule that does: the nest in which the next
    panel's fetch (``prefetch_next_b``, timed as its twins) hides the stream, which the model has
    no term for. Which nest the model ranks first moves with the micro-kernel table measured at
    start-up: in one run every 1x1 convolution of 8 images was shortlisted with ``ir,jr`` only
    and ran at 0.72-0.92x MKL, where the ``jr,ir`` nest with the fetch ran at 0.95-1.0x. A nest
    that reads B in place comes with its twin packing each panel in its first tile, fetching the
    next (the pair the prefetch twins give a packing schedule)."""
    gemms = [t for t in picked if isinstance(t.schedule, GemmSchedule)]
    if not gemms or any(t.schedule.inner == "jr,ir" for t in gemms) or not b_streams(op, machine):
        return []
    chosen = {t.schedule for t in picked}
    best = next((t for t in trials if isinstance(t.schedule, GemmSchedule) and t.schedule.inner == "jr,ir"
                 and t.schedule not in chosen), None)
    if best is None:
        return []
    out = [best]
    if not effective_packing(op, best.schedule)[1]:  # read in place: its twin packing each panel in its first tile too
        fused = first_tile_packing(op, best.schedule)
        if fused is not None and (fused := dataclasses.replace(fused, prefetch_next_b=True)) not in chosen:
            out.append(Trial(fused, predict(op, fused, machine, threads)))
    return out


def _packs_both(s: GemmSchedule) -> bool:
    return s.pack_a and s.pack_b


def _lowering(s: Schedule) -> str:
    """The micro-kernel, the loops, Winograd, or one direct kernel (each direct kernel its own)."""
    return f"direct:{s.algo}" if s.kind == "direct" else s.kind


def random_inputs(op: Operator, seed: int = 0) -> list[np.ndarray]:
    """Standard-normal inputs of ``op``, each starting on a cache line (as torch's tensors do)."""
    return aligned_normal([t.shape for t in op.inputs], seed)


REJECT_FACTOR = 1.5  # a first run this much slower than the best median so far ends the candidate ...
REJECT_AFTER_S = 0.05  # ... when it took this long (cold-call costs are then a small part of it)


# a candidate predicted at over SKIP_PREDICTED_S a call and over SKIP_FACTOR x the best median so
# far is not timed at all: its one call would cost more than the whole tuning (a streaming loop
# nest of 4096x768x3072, predicted 5.4 s a call against AMX's measured 0.08 s, ran 93 s and made
# that shape's tuning 122 s). Large enough to keep every winner of the committed kernels runs
# (the model over-predicted no timed candidate by more than 8x, and those were calls of
# microseconds, far under the floor).
SKIP_PREDICTED_S = 1.0
SKIP_FACTOR = 10.0


LONG_CALL_S = 0.25  # a call this long is timed once a measurement, and needs no untimed warm-up run


def _repeats(repeats: int, seconds: float) -> int:
    """Timed runs of a candidate that takes ``seconds`` a call: at most ``repeats``, about a
    second's worth, at least 3 (1 for a long call: 4096^3 on 1 thread takes 1.4-1.6 s a call
    here, and three of them per measurement made its tuning 172 s on the Milan VM; the finalist
    rounds still time every finalist at every placement)."""
    return max(3 if seconds < LONG_CALL_S else 1, min(repeats, int(1.0 / max(seconds, 1e-6))))


def _measure(trial: Trial, kernel, inputs, threads: int, repeats: int, best: float) -> None:
    """Median of up to ``repeats`` timed runs (about a second per candidate at most) after
    a timed warm-up run and an untimed one. A candidate whose long warm-up run is already far slower than the
    best median found keeps that one time (its cold cost, a few per cent above a warm one at
    that length): the rank stays right, and large shapes tune in a fraction of the time."""
    first = kernel.time(*inputs, threads=threads, repeats=1, warmup=0)[0]
    if first > REJECT_AFTER_S and first > REJECT_FACTOR * best:
        trial.times, trial.measured, trial.rejected = [first], first, True
        return
    reps = _repeats(repeats, first)
    # one more untimed run: a kernel with scratch of its own (Winograd's transforms) is still
    # warming its caches and pages on the second call (1.9 ms, then 1.3-1.4 at 64ch 56x56);
    # a long call's first run warmed them a small share of its time
    trial.times = kernel.time(*inputs, threads=threads, repeats=reps, warmup=int(first < LONG_CALL_S))
    trial.measured = statistics.median(trial.times)


def _placements(inputs: list[np.ndarray]) -> list[list[np.ndarray]]:
    """``inputs`` as given (on cache lines, as torch allocates) and a copy of each 16 bytes past
    a line (as numpy's large arrays lie), each input at its own offset from a page. A kernel
    that reads an operand in place depends on where it lies (128x768x3072 with B in place ran
    at 106 to 154 GFLOP/s by where B lay: 16 bytes off a line, every B row's vector loads split
    across two lines), so the finalists are judged at both."""
    moved = []
    for i, x in enumerate(inputs):
        offset = 16 + 64 * (1 + 17 * i) % 4096  # bytes past a page: off a line, a set of its own
        buf = np.empty(x.size + 2048, dtype=np.float32)
        start = (-buf.ctypes.data % 4096 + offset) // 4
        view = buf[start:start + x.size].reshape(x.shape)
        view[...] = x
        moved.append(view)
    return [list(inputs), moved]


FINALISTS = 3  # the fastest this many of the first timing ...
FINAL_ROUNDS = 2  # ... are timed again this many times per placement of the inputs, in turn


def final_rounds(picked: list[Trial], retime, placements: int = 1, rounds: int = FINAL_ROUNDS,
                 judge=max) -> Trial:
    """The trial to keep: the fastest of the first timing's ``FINALISTS`` best, each timed
    again (``retime(i, p)``: a median of repeats of ``picked[i]`` at placement ``p``) in
    ``rounds`` interleaved rounds per placement, judged by ``judge`` of its placements' medians
    (``max``: its slowest placement's).
    Candidates timed one after another each meet the machine at another moment, and this VM's
    speed moves by 10% over seconds; every finalist meets every placement (a direct kernel
    reads its inputs in place as much as a GEMM that does not pack them). Each finalist's
    times are kept in ``Trial.rounds`` (placement by placement, round after round);
    ``Trial.measured`` stays the first timing's median."""
    timed = sorted((i for i, t in enumerate(picked) if t.times and not t.rejected), key=lambda i: picked[i].measured)
    finalists = timed[:FINALISTS]
    if len(finalists) < 2:
        return min((t for t in picked if t.measured is not None), key=lambda t: t.measured)
    for r in range(rounds * placements):
        for i in finalists:
            picked[i].rounds.append(retime(i, r % placements))

    def score(i: int) -> float:
        return judge([statistics.median(picked[i].rounds[p::placements]) for p in range(placements)])

    return picked[min(finalists, key=score)]


# Other schedule kinds (tessera.stencil) time and record their candidates with these: an
# ``op`` needs only ``signature()``, a schedule ``key()``, a kernel ``time(*inputs, ...)``.
def measure_trial(trial: Trial, kernel, inputs, threads: int, repeats: int, best: float) -> None:
    _measure(trial, kernel, inputs, threads, repeats, best)


def save_choice(op, threads: int, machine: Machine, schedule, mode: str = "measure") -> None:
    _save(op, threads, machine, schedule, mode)


def saved_choice(op, threads: int, machine: Machine) -> dict | None:
    """The recorded entry ({"schedule": ..., "mode": ...}) or None."""
    path = _db_path(op, threads, machine)
    return json.loads(path.read_text()) if path.exists() else None


def tune(
    op: Operator, *, threads: int = 1, machine: Machine | None = None, top_k: int = 6, repeats: int = 7,
    extra: list[Schedule] | None = None,
) -> Tuned:
    """Rank the space by the model, then compile and time only the shortlist (and ``extra``)."""
    began = time.perf_counter()
    machine = machine or load_machine()
    trials = rank(op, threads=threads, machine=machine)
    model_seconds = time.perf_counter() - began
    picked = shortlist(trials, top_k)
    nest = streaming_nest(op, trials, picked, machine, threads)
    twins = prefetch_twins(op, picked, machine, threads)
    # the streaming nest's own twins (it is not one of the two best packing ones prefetch_twins takes)
    seen = {t.schedule for t in twins}
    for t in prefetch_twins(op, nest, machine, threads):
        if t.schedule not in seen:
            seen.add(t.schedule)
            twins.append(t)
    picked += nest + twins
    for s in extra or ():
        picked.append(Trial(s, predict(op, s, machine, threads)))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        kernels = list(pool.map(lambda t: compile_kernel(op, t.schedule), picked))
    compile_seconds = time.perf_counter() - t0
    inputs = random_inputs(op)
    t0 = time.perf_counter()
    best_so_far = float("inf")
    for trial, kernel in zip(picked, kernels, strict=True):
        trial.compile_seconds = kernel.compiled.compile_seconds
        if trial.predicted > max(SKIP_PREDICTED_S, SKIP_FACTOR * best_so_far):
            trial.rejected = True  # not timed: measured stays None
            continue
        _measure(trial, kernel, inputs, threads, repeats, best_so_far)
        best_so_far = min(best_so_far, trial.measured)
    placements = _placements(inputs)

    def retime(i: int, p: int) -> float:
        return statistics.median(kernels[i].time(*placements[p], threads=threads,
                                                 repeats=_repeats(repeats, picked[i].measured)))

    # the mean of the two placements' medians: a GEMM schedule that reads B in place packs it
    # when B's rows are off cache lines (codegen_gemm.b_in_place_when_lined), so no placement
    # is far off any more, and the one torch's tensors take (on lines) counts as much as the other
    best = final_rounds(picked, retime, placements=len(placements), judge=statistics.fmean).schedule
    measure_seconds = time.perf_counter() - t0
    tuned = Tuned(op, threads, best, picked, len(trials), model_seconds, compile_seconds, measure_seconds,
                  time.perf_counter() - began)
    _save(op, threads, machine, best, "measure")
    return tuned


def _db_path(op: Operator, threads: int, machine: Machine):
    key = hashlib.sha256(f"{op.signature()}|{threads}|{machine.fingerprint}".encode()).hexdigest()[:32]
    return cache_dir() / "tuned" / f"{key}.json"


def _save(op: Operator, threads: int, machine: Machine, schedule: Schedule, mode: str) -> None:
    path = _db_path(op, threads, machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps({"op": op.signature(), "threads": threads, "mode": mode,
                                   "schedule": json.loads(schedule.key())}))
    os.replace(partial, path)


def best_schedule(op: Operator, *, threads: int = 1, machine: Machine | None = None, mode: str = "model") -> Schedule:
    """The tuned schedule if there is one, else (``model``) the model's choice or (``measure``) tune now."""
    if mode not in MODES:
        raise ValueError(f"tuning mode {mode!r}; choose one of {', '.join(MODES)}")
    machine = machine or load_machine()
    path = _db_path(op, threads, machine)
    if path.exists():
        entry = json.loads(path.read_text())
        if mode == "model" or entry["mode"] == "measure":
            return schedule_from_dict(entry["schedule"])
    if mode == "measure":
        return tune(op, threads=threads, machine=machine).best
    best = rank(op, threads=threads, machine=machine)[0].schedule
    _save(op, threads, machine, best, "model")
    return best


__all__ = ["GemmSchedule", "Trial", "Tuned", "best_schedule", "final_rounds", "rank", "shortlist", "spearman", "tune"]
