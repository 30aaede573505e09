"""`tessera bench kernels`: Tessera's operator compiler against the strongest CPU libraries
here, each at its best and each with the code path it ran (``bench/kernels_anchors.py``):
OpenBLAS, BLIS and AMD's AOCL-BLAS (GEMM), torch through MKL, MKL's packed SGEMM and oneDNN (GEMM) and through
its default dispatch, oneDNN and prepacked oneDNN (convolution), Apache TVM MetaSchedule
(optional extra) on a few shapes; numpy as a sanity row.

Measured machine peak and bandwidth first; then SGEMM at square sizes, the projections and
MLPs of BERT-base and GPT-2 at 128-4096 tokens, matrix-vector products (one token) and odd
sizes no register tile divides, the distinct conv shapes of ResNet-50, the depthwise convs
of MobileNetV2 and ConvNeXt-T and the grouped ones of ResNeXt-50 (batch 1 and 8),
on 1 and 2 threads. Every Tessera kernel is tuned in
the run (model ranks the space, a shortlist is timed) and its tuning time recorded; every
time is the median of repeats after a warm-up, Tessera and anchors alike. A model-validation
sample (schedules spread over the predicted range) gives the rank correlation of predicted
and measured times beyond the shortlist. Last, a ResNet-8 trains on the digits with every
conv and linear on Tessera's kernels beside the same model on torch's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from tessera.bench import kernels_anchors as ka
from tessera.bench.harness import BenchResult
from tessera.bench.kernels_headline import GIGA
from tessera.bench.kernels_headline import headline as make_headline
from tessera.bench.kernels_training import train_curves
from tessera.kernels import ops, tvm_anchor
from tessera.kernels.kernel import compile_kernel
from tessera.kernels.machine import measure, peak_flops, save_machine
from tessera.kernels.model import predict
from tessera.kernels.schedule import GemmSchedule
from tessera.kernels.tuner import random_inputs, rank, spearman, tune
from tessera.kernels.tvm_anchor import DOCUMENTED_CPU_TRIALS, tvm_mcpu

# (in, out, size, kernel, stride, padding): every distinct conv of torchvision's ResNet-50 at 224x224
RESNET50_CONVS = [
    (3, 64, 224, 7, 2, 3), (64, 64, 56, 1, 1, 0), (64, 64, 56, 3, 1, 1), (64, 256, 56, 1, 1, 0),
    (256, 64, 56, 1, 1, 0), (256, 128, 56, 1, 1, 0), (128, 128, 56, 3, 2, 1), (128, 512, 28, 1, 1, 0),
    (256, 512, 56, 1, 2, 0), (512, 128, 28, 1, 1, 0), (128, 128, 28, 3, 1, 1), (512, 256, 28, 1, 1, 0),
    (256, 256, 28, 3, 2, 1), (256, 1024, 14, 1, 1, 0), (512, 1024, 28, 1, 2, 0), (1024, 256, 14, 1, 1, 0),
    (256, 256, 14, 3, 1, 1), (1024, 512, 14, 1, 1, 0), (512, 512, 14, 3, 2, 1), (512, 2048, 7, 1, 1, 0),
    (1024, 2048, 14, 1, 2, 0), (2048, 512, 7, 1, 1, 0), (512, 512, 7, 3, 1, 1),
]

# (in, out, size, kernel, stride, padding, groups): depthwise convolutions of MobileNetV2 (3x3,
# stride 1 and 2) and ConvNeXt-T (7x7), and the grouped 3x3 convolutions of ResNeXt-50 32x4d
DEPTHWISE_GROUPED_CONVS = [
    (32, 32, 112, 3, 1, 1, 32), (96, 96, 112, 3, 2, 1, 96), (144, 144, 56, 3, 1, 1, 144),
    (192, 192, 28, 3, 1, 1, 192), (384, 384, 14, 3, 1, 1, 384), (960, 960, 7, 3, 1, 1, 960),
    (96, 96, 56, 7, 1, 3, 96), (192, 192, 28, 7, 1, 3, 192), (384, 384, 14, 7, 1, 3, 384), (768, 768, 7, 7, 1, 3, 768),
    (128, 128, 56, 3, 1, 1, 32), (256, 256, 28, 3, 2, 1, 32), (512, 512, 14, 3, 1, 1, 32), (1024, 1024, 7, 3, 1, 1, 32),
]


def _transformer_gemms() -> tuple[tuple[str, int, int, int], ...]:
    """(label, M, N, K) of BERT-base's and GPT-2's dense layers (hidden 768, MLP 3072; GPT-2's
    fused QKV 2304) at 128-4096 tokens, and the same layers for one token (matrix-vector)."""
    layers = (("attn.q/k/v/out", 768, 768), ("gpt2.c_attn", 2304, 768), ("mlp.up", 3072, 768),
              ("mlp.down", 768, 3072))
    shapes = [(f"{name} T={t}", t, n, k) for t in (128, 512, 2048, 4096) for name, n, k in layers]
    return tuple(shapes + [(f"{name} T=1 (matvec)", 1, n, k) for name, n, k in layers])


# sizes that no register tile (multiples of 4, 8, 16) or cache tile divides
ODD_GEMMS = (("odd", 97, 1001, 513), ("odd", 333, 777, 555), ("odd", 1023, 1025, 1027), ("odd", 129, 3071, 767))


@dataclass(frozen=True, kw_only=True)
class KernelsPlan:
    gemm_sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    gemm_shapes: tuple[tuple[str, int, int, int], ...] = _transformer_gemms() + ODD_GEMMS
    conv_batches: tuple[int, ...] = (1, 8)
    convs: tuple[tuple[int, ...], ...] = tuple(RESNET50_CONVS + DEPTHWISE_GROUPED_CONVS)
    threads: tuple[int, ...] = (1, 2)
    machine_seconds: float = 0.3
    top_k: int = 5
    repeats: int = 5
    # timing rounds per case (tuned once): Tessera then every anchor, again; a row's figures are
    # medians over rounds, and the headline gives each round's win fraction and geomean (the
    # spread). On this VM the second core comes and goes for seconds at a time (a 2-thread GEMM
    # tuned at one thread's speed, then at twice it minutes later): rounds keep each comparison
    # near in time and show how much the figures move
    rounds: int = 3
    # OpenBLAS's and BLIS's kernel set: "widest" (this CPU's widest ISA), "auto" (their own pick)
    blas_kernel_set: str = "widest"
    settle_s: float = ka.SETTLE_S  # pause after each multi-threaded anchor loop (idle workers stop spinning)
    # MetaSchedule's measured candidates per shape, with its curve (32 took about 2 minutes a shape here)
    tvm_trials: int = DOCUMENTED_CPU_TRIALS
    tvm_gemms: tuple[tuple[int, int, int], ...] = ((1024, 1024, 1024), (512, 3072, 768))  # (M, N, K), 1 thread
    tvm_convs: tuple[int, ...] = (2,)  # indices into convs, batch 1, 1 thread
    validation: tuple[str, ...] = ("gemm:512", "conv:2", "conv:12")
    validation_samples: int = 12
    train_steps: int = 150

    def __post_init__(self):
        if self.settle_s < 0:
            raise ValueError(f"settle_s={self.settle_s}: a pause cannot be negative (0 for none)")
        if self.rounds < 1:
            raise ValueError(f"rounds={self.rounds}: each case needs at least 1 timing round")
        if self.tvm_trials < 1:
            raise ValueError(f"tvm_trials={self.tvm_trials}: MetaSchedule needs at least 1 measured trial per shape")
        for name, m, n, k in self.gemm_shapes:
            if min(m, n, k) < 1:
                raise ValueError(f"gemm shape {name!r} has M, N, K = {m}, {n}, {k}; each must be >= 1")


FULL = KernelsPlan()
QUICK = KernelsPlan(
    gemm_sizes=(256,), gemm_shapes=(), conv_batches=(1,),  # each new shape compiles its shortlist
    convs=((64, 64, 14, 3, 1, 1), (128, 256, 14, 1, 2, 0), (32, 32, 14, 3, 1, 1, 32)),
    machine_seconds=0.05, top_k=3, repeats=3, tvm_trials=8, tvm_gemms=(), tvm_convs=(),  # TVM: > 2 min alone
    settle_s=0.0, rounds=2,  # a plumbing check, not figures (2 rounds: the spread's plumbing)
    validation=("gemm:256",), validation_samples=6, train_steps=4,
)


# the square SGEMM rows alone (`tessera bench kernels --square-only`: ~6 minutes), for their
# fraction of the same-moment FMA peak; TVM left out, the model validated on one GEMM
SQUARE = dataclasses.replace(FULL, gemm_shapes=(), convs=(), tvm_gemms=(), tvm_convs=(), validation=("gemm:512",),
                             train_steps=4)

# TVM's shapes alone (`tessera bench kernels --tvm-only`; 36 minutes at 256 trials a shape on
# the Milan VM, about 45 minutes a shape at the documented 1000): the full plan's TVM shapes,
# derived from its tvm_gemms / tvm_convs, at 1 thread with every anchor beside them, so a
# machine that has not run the whole plan gets TVM's curve and when it matches Tessera
TVM = dataclasses.replace(
    FULL, gemm_sizes=tuple(m for m, n, k in FULL.tvm_gemms if m == n == k),
    gemm_shapes=tuple(s for s in FULL.gemm_shapes if s[1:] in FULL.tvm_gemms),
    convs=tuple(FULL.convs[i] for i in FULL.tvm_convs), tvm_convs=tuple(range(len(FULL.tvm_convs))),
    conv_batches=FULL.conv_batches[:1], threads=(1,), validation=("gemm:512",), train_steps=4,
)  # fmt: skip


def _median_seconds(call, repeats: int) -> float:
    call()
    first = time.perf_counter()
    call()
    first = time.perf_counter() - first
    reps = max(3, min(repeats, int(2.0 / max(first, 1e-6))))
    times = [first]
    for _ in range(reps - 1):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _conv_shape(spec, batch: int) -> ops.Conv2dShape:
    cin, cout, size, k, stride, pad, *groups = spec
    return ops.Conv2dShape(batch=batch, in_channels=cin, out_channels=cout, height=size, width=size,
                           kernel=(k, k), stride=(stride, stride), padding=(pad, pad), groups=groups[0] if groups else 1)


def _cases(plan: KernelsPlan):
    for n in plan.gemm_sizes:
        yield "gemm", f"{n}^3", ops.gemm(n, n, n), (n, n, n), 2.0 * n**3
    for name, m, n, k in plan.gemm_shapes:
        yield "gemm", f"{name} {m}x{n}x{k}", ops.gemm(m, n, k), (m, n, k), 2.0 * m * n * k
    for batch in plan.conv_batches:
        for i, spec in enumerate(plan.convs):
            s = _conv_shape(spec, batch)
            yield "conv", f"#{i} {s.label()}", ops.conv2d(s), s, float(s.flops)


def algorithm(schedule) -> str:
    """How a schedule computes: the micro-kernel GEMM (an implicit GEMM for a conv), a loop nest,
    a direct kernel (depthwise, gemv) or Winograd F(m, 3)."""
    kind = schedule.kind
    if kind == "direct":
        return "amx bf16x6" if schedule.algo == "amx" else schedule.algo
    if kind == "winograd":
        return f"winograd F({schedule.m},3)"
    return {"gemm": "micro-kernel", "loops": "loop nest"}[kind]


def _min_bytes(op) -> float:
    return 4.0 * (op.output.tensor.numel + sum(t.numel for t in op.inputs))


PEAK_PROBE_S = 0.3  # the same-moment FMA peak's probe, per round of a square GEMM row


def _measure_case(kind, label, op, spec, flops, threads, plan, machine, anchor_set) -> dict:
    tuned = tune(op, threads=threads, machine=machine, top_k=plan.top_k, repeats=plan.repeats)
    kernel = compile_kernel(op, tuned.best)
    inputs = random_inputs(op)
    # a bound call (checks, output and pointers once), as the BLAS anchors' prepared calls are
    call, _ = kernel.bind(*inputs, threads=threads)
    prepacked = _prepacked_call(kind, op, tuned, inputs, threads, plan.repeats)
    fma = _fma_call(op, tuned, inputs, threads)
    rounds = []
    # the square GEMMs' fraction of peak: the FMA peak probed in each round just before
    # Tessera's timing, so the two share the VM's moment (the run's start-up probe can be
    # 20 minutes and 10% away: 228 GFLOP/s at the start of a run whose 2048^3 row met 237)
    same_moment_peak = kind == "gemm" and label.endswith("^3")
    for _ in range(plan.rounds):
        peak = {"peak_gflops": round(peak_flops(threads, seconds=PEAK_PROBE_S, isa=machine.isa) / GIGA, 2)} \
            if same_moment_peak else {}
        seconds = _median_seconds(call, plan.repeats)
        got = anchor_set.measure(kind, spec, threads, flops, _median_seconds, plan.repeats, plan.settle_s)
        if prepacked is not None:
            got["tessera_prepacked_gflops"] = round(flops / _median_seconds(prepacked, plan.repeats) / GIGA, 2)
        if fma is not None:
            got["tessera_fma_gflops"] = round(flops / _median_seconds(fma, plan.repeats) / GIGA, 2)
        rounds.append({"gflops": round(flops / seconds / GIGA, 2), "seconds": seconds, **peak, **got})
    row = {
        "kind": kind, "shape": label, "threads": threads, **ka.median_of_rounds(rounds),
        "predicted_s": predict(op, tuned.best, machine, threads),
        "schedule": tuned.best.short(), "algorithm": algorithm(tuned.best),
        "model_algorithm": algorithm(min(tuned.trials, key=lambda t: t.predicted).schedule),
        "tuning_s": round(tuned.wall_seconds, 2), "space": tuned.space_size,
        "measured_candidates": sum(t.measured is not None for t in tuned.trials), "spearman": round(tuned.spearman, 3),
        "intensity": flops / _min_bytes(op), "flops": flops,
        "trials": [{"schedule": t.schedule.short(), "predicted_s": t.predicted, "measured_s": t.measured}
                   for t in tuned.trials],
    }
    if kind == "gemm":
        row["mnk"] = list(spec)
    return row


def _fma_call(op, tuned, inputs, threads):
    """Where the tuned kernel is the AMX GEMM: the bound call of the fastest schedule of the
    tuning that runs on FMAs (the FMA kernels' own figure, timed in the same rounds), else None."""
    if getattr(tuned.best, "algo", None) != "amx":
        return None
    timed = [t for t in tuned.trials if t.measured is not None and getattr(t.schedule, "algo", None) != "amx"]
    if not timed:
        return None
    return compile_kernel(op, min(timed, key=lambda t: t.measured).schedule).bind(*inputs, threads=threads)[0]


def _prepacked_call(kind, op, tuned, inputs, threads, repeats):
    """The row's weight packed once, outside the timing, and read packed by each call (as MKL's
    packed SGEMM and oneDNN's reordered weights are): a GEMM's B (input 1) under the tuned
    micro-kernel schedule; a convolution's weight (input 0) under the tuned schedule when it
    can take it (a micro-kernel that packs A, ``flatc``, ``flatcl``, Winograd), and under the
    fastest timed ``flatc`` / ``flatcl`` schedule of the tuning, the faster of the two (a GEMM's
    B likewise under the fastest timed AMX schedule, where one was timed). None when neither
    applies."""
    index = 1 if kind == "gemm" else 0
    schedules = []
    if isinstance(tuned.best, GemmSchedule):
        schedules.append(tuned.best.packing_b() if index else dataclasses.replace(tuned.best, pack_a=True))
    else:
        schedules.append(tuned.best)
    own = ("amx",) if kind == "gemm" else ("flatc", "flatcl")
    timed = [t for t in tuned.trials if t.measured is not None and getattr(t.schedule, "algo", None) in own]
    if timed:
        schedules.append(min(timed, key=lambda t: t.measured).schedule)
    calls = []
    for schedule in dict.fromkeys(schedules):
        kernel = compile_kernel(op, schedule)
        if kernel.prepack_operand(index) is not None:
            calls.append(kernel.bind(*inputs, threads=threads, constant=index)[0])
    if len(calls) > 1:
        calls.sort(key=lambda c: _median_seconds(c, repeats))
    return calls[0] if calls else None


def _tvm_rows(plan: KernelsPlan, rows: list[dict], progress: bool) -> str | None:
    """TVM MetaSchedule on a few of the shapes (1 thread): its tuned speed, tuning time and
    speed-versus-trials curve."""
    if not plan.tvm_gemms and not plan.tvm_convs:
        return None  # nothing to tune: TVM is not even imported (about 2 s)
    status = tvm_anchor.tvm_status()
    if status is not None:
        return status
    jobs = []
    for mnk in plan.tvm_gemms:
        row = next((r for r in rows if r.get("mnk") == list(mnk) and r["threads"] == 1), None)
        jobs.append((row, "gemm", tuple(mnk)))
    for i in plan.tvm_convs:
        s = _conv_shape(plan.convs[i], plan.conv_batches[0])
        row = next((r for r in rows if r["kind"] == "conv" and r["shape"] == f"#{i} {s.label()}"
                    and r["threads"] == 1), None)
        jobs.append((row, "conv", s))
    errors = []
    for row, kind, spec in tqdm(jobs, desc="tvm", disable=not progress):
        if row is None:
            continue
        got = tvm_anchor.tvm_measure(kind, spec, 1, plan.tvm_trials, plan.repeats, cache=tvm_anchor.default_cache())
        if "error" in got:
            row["tvm_error"] = got["error"]
            errors.append(f"{row['shape']}: {got['error']}")
            continue
        row["tvm_gflops"] = round(row["flops"] / got["seconds"] / GIGA, 2)
        row["tvm_tuning_s"] = round(got["tuning_s"], 1)
        row["tvm_tuning_reused"] = got["tuning_reused"]  # tuned by an earlier run (its database kept)
        row["tvm_tuned_at"] = got["tuned_at"]
        row["tvm_tuned"] = got["tuned"]
        row["tvm_trials"] = plan.tvm_trials
        row["tvm_measured_trials"] = got["measured_trials"]
        row["tvm_curve"] = got["curve"]
        row["tvm_code_path"] = got["code_path"]
        row["tvm_matches_tessera_after_s"] = ka.tvm_match_time(row)
    return "; ".join(errors) if errors and len(errors) == len(jobs) else None


def _validation(plan: KernelsPlan, machine) -> list[dict]:
    """Schedules spread evenly over the model's ranking of the whole space, each timed."""
    cases = {f"gemm:{n}": ops.gemm(n, n, n) for n in plan.gemm_sizes}
    cases |= {f"conv:{i}": ops.conv2d(_conv_shape(spec, 1)) for i, spec in enumerate(plan.convs)}
    out = []
    for key in plan.validation:
        if key not in cases:
            continue
        op = cases[key]
        ranked = rank(op, threads=1, machine=machine)
        step = max(1, len(ranked) // plan.validation_samples)
        picks = ranked[::step][: plan.validation_samples]
        random.Random(0).shuffle(picks)
        inputs = random_inputs(op)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # compiles only
            kernels = list(pool.map(lambda t, o=op: compile_kernel(o, t.schedule), picks))
        pairs = [(trial.predicted, _median_seconds(lambda k=kernel, x=inputs: k(*x, threads=1), 3))
                 for trial, kernel in zip(picks, kernels, strict=True)]
        out.append({"case": key, "samples": len(pairs), "space": len(ranked),
                    "spearman": round(spearman(*zip(*pairs, strict=True)), 3), "pairs": pairs})
    return out


@contextlib.contextmanager
def _fresh_kernel_cache():
    """An empty kernel cache for the run, so every tuning time includes its compiles."""
    old = os.environ.get("TESSERA_KERNEL_CACHE")
    with tempfile.TemporaryDirectory(prefix="tessera-bench-kernels-") as tmp:
        os.environ["TESSERA_KERNEL_CACHE"] = tmp
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TESSERA_KERNEL_CACHE", None)
            else:
                os.environ["TESSERA_KERNEL_CACHE"] = old


def run_kernels_bench(
    plan: KernelsPlan = FULL, *, progress: bool = True, machine=None, fresh_cache: bool = True
) -> BenchResult:
    """``machine``: a Machine already measured (else measured here for ``plan.machine_seconds``
    a figure); ``fresh_cache=False`` keeps the current kernel cache (the test suite's, where
    other tests compiled the same kernels), so tuning times then exclude those compiles."""
    if not fresh_cache:
        return _run(plan, progress, machine)
    with _fresh_kernel_cache():
        return _run(plan, progress, machine)


def _run(plan: KernelsPlan, progress: bool, machine=None) -> BenchResult:
    began = time.perf_counter()
    if machine is None:
        machine = measure(seconds=plan.machine_seconds)
        save_machine(machine)
    anchor_set = ka.AnchorSet(plan.blas_kernel_set)
    rows, specs = [], {}
    cases = [(c, t) for c in _cases(plan) for t in plan.threads]
    for (kind, label, op, spec, flops), threads in tqdm(cases, desc="bench kernels", disable=not progress):
        specs[len(rows)] = spec
        rows.append(_measure_case(kind, label, op, spec, flops, threads, plan, machine, anchor_set))
    tvm_note = _tvm_rows(plan, rows, progress)
    if tvm_note is not None:
        anchor_set.absent["tvm"] = tvm_note
    # after every timing: the verbose child runs one call per torch path, the libraries report
    anchor_report = ka.attach_code_paths(rows, specs, anchor_set)
    validation = _validation(plan, machine)
    curves = train_curves(plan.train_steps)
    from tessera.bench.machine import machine_rows

    headline = make_headline(rows, machine, validation, tvm_note, curves, anchor_report, anchor_set.absent)
    notes = [
        f"Tessera: tuned in the run (the model ranks the whole space, the best {plan.top_k} predicted plus the best "
        f"of the other lowering are compiled and timed, median of up to {plan.repeats}); anchors: median of repeats.",
        f"Timing rounds: each case tuned once, then timed in {plan.rounds} rounds (Tessera, then every anchor, "
        "again); a row's figures are medians over its rounds; win_fraction_rounds and geomean_rounds are each "
        "round's own figures (their range is the run's spread).",
        f"Anchors: OpenBLAS, BLIS and AMD's AOCL-BLAS through ctypes ({plan.blas_kernel_set} kernel set), torch's GEMM through MKL "
        "(torch.mm), MKL's packed SGEMM and oneDNN's matmul (weights packed/reordered once, outside the timing), "
        "torch's conv through its default dispatch, oneDNN forced and oneDNN on a reordered weight; torch's anchor "
        "is its best path per shape. Thread counts are set once around each timing loop. Tessera's kernel is "
        "timed as a bound call (checks, output and pointers once), as the BLAS anchors' prepared calls and "
        "torch.mm(out=) are; torch's convolutions allocate their output in each call (their oneDNN paths take no "
        "out=).",
        "tessera_prepacked_gflops: the row's weight packed once at bind, outside the timing (GEMM rows: B under the row's schedule; "
        "conv rows: the weight under the row's schedule where it takes it, or the tuning's fastest flatc / flatcl schedule, the faster), "
        "and read packed by every call (Kernel.bind(constant=...)), the like-for-like counterpart of MKL's packed "
        "SGEMM (prepacked_vs_mkl_packed_geomean) and oneDNN's reordered weights; the win fraction and geomean take the plain call, "
        "win_fraction_ / geomean_either_side_prepacked take each side's faster of packing per call and packing "
        "the weight once (the anchors' figures already include MKL's packed SGEMM and oneDNN's reordered weights).",
        "Code paths: OpenBLAS's openblas_get_corename / get_config, BLIS's bli_arch_query_id, threadpoolctl; torch's "
        "from MKL_VERBOSE / ONEDNN_VERBOSE and the ATen ops of one call per path in a child process, after the timings.",
        "Tessera's AMX GEMM (algorithm 'amx bf16x6', where the CPU has AMX-BF16): float32 accuracy from six bfloat16 "
        "tile products a product (tested against float64 at a float32 GEMM's tolerance); no anchor computes float32 "
        "on AMX at that accuracy (MKL's and oneDNN's float32 GEMMs run on FMAs; oneDNN's bf16 fpmath mode rounds "
        "each input to one bfloat16, about 3 significant digits, and is not a float32 anchor). tessera_fma_gflops: "
        "on rows where the AMX kernel was chosen, the tuning's fastest FMA schedule timed in the same rounds "
        "(the FMA kernels' own figure; sgemm_*_fma_fraction_* in the headline).",
        "numpy is a sanity row, not an anchor; its conv is im2col (sliding windows of the padded input) + one "
        "matmul per group.",
        ("TVM: not run (this plan has no TVM shapes: `--tvm-trials 0` or `--quick`)."
         if not (plan.tvm_gemms or plan.tvm_convs) else
         f"TVM: MetaSchedule, {plan.tvm_trials} trials per shape, target llvm -mcpu={tvm_mcpu()}, 1 thread; "
         + (f"absent: {tvm_note}." if tvm_note is not None
           else "its tuning time and speed-versus-trials curve are recorded per shape; a finished tuning is kept "
           "(MetaSchedule's database) and a later run times TVM's best from it, saying so (tvm_tuning_reused, "
           "tvm_tuned_at).")),
        "A win: Tessera >= 0.95x the best anchor measured for that shape and thread count.",
        f"Whole run {time.perf_counter() - began:.0f} s on {machine.cores} cores.",
    ]
    columns = ["kind", "shape", "threads", "gflops", "tessera_prepacked_gflops", "tessera_fma_gflops", "openblas_gflops", "blis_gflops", "aocl_blis_gflops",
               "torch_gflops", "torch_path",
               "tvm_gflops", "numpy_gflops", "best_anchor", "vs_best_anchor", "best_anchor_path", "tuning_s",
               "tvm_tuning_s", "algorithm", "schedule"]
    tables = [("Machine", ["what", "threads", "value", "unit"], machine_rows(machine)),
              ("Anchors: the code path each ran", ["anchor", "library", "detected_alone", "forced", "ran",
                                                    "threadpoolctl"], ka.code_path_table(anchor_report)),
              ("Anchors absent", ["anchor", "why"], [{"anchor": k, "why": v} for k, v in anchor_set.absent.items()]),
              ("TVM MetaSchedule: speed versus trials", ["shape", "trials", "tuning_s", "tvm_best_gflops",
                                                          "tessera_gflops"], ka.tvm_curve_rows(rows)),
              ("Model validation (schedules spread over the ranked space)", ["case", "space", "samples", "spearman"],
               validation)]
    tables = [t for t in tables if t[2]]  # no empty table (nothing absent, no TVM shapes)
    if curves:
        tables.append(("ResNet-8 on digits: Tessera kernels vs torch", ["step", "torch", "tessera", "gap"],
                       curves["table"]))
    return BenchResult(name="kernels", headline=headline, rows=rows, columns=columns, notes=notes, tables=tables,
                       extra={"machine_parameters": machine.to_json(), "validation": validation, "training": curves,
                              "anchor_code_paths": anchor_report, "anchors_absent": anchor_set.absent})


def plot_kernels(result: BenchResult, path: Path) -> None:
    from tessera.bench.machine import plot_roofline

    plot_roofline(result, path)
