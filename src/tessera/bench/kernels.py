"""`tessera bench kernels`: Tessera's operator compiler against torch (its CPU BLAS / oneDNN),
numpy (BLAS; conv as im2col + matmul) and Apache TVM MetaSchedule (optional extra).

Measured machine peak and bandwidth first; then SGEMM at square sizes and the distinct conv
shapes of ResNet-50 (batch 1 and 8) on 1 and 2 threads. Every Tessera kernel is tuned in
the run (model ranks the space, a shortlist is timed) and its tuning time recorded; every
time is the median of repeats after a warm-up, Tessera and anchors alike. A model-validation
sample (schedules spread over the predicted range) gives the rank correlation of predicted
and measured times beyond the shortlist. Last, a ResNet-8 trains on the digits with every
conv and linear on Tessera's kernels beside the same model on torch's.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from tessera.bench.harness import BenchResult
from tessera.kernels import anchors, ops
from tessera.kernels.anchors import tvm_mcpu
from tessera.kernels.kernel import compile_kernel
from tessera.kernels.machine import measure, save_machine
from tessera.kernels.model import predict
from tessera.kernels.tuner import random_inputs, rank, spearman, tune

GIGA = 1e9
# (in, out, size, kernel, stride, padding): every distinct conv of torchvision's ResNet-50 at 224x224
RESNET50_CONVS = [
    (3, 64, 224, 7, 2, 3), (64, 64, 56, 1, 1, 0), (64, 64, 56, 3, 1, 1), (64, 256, 56, 1, 1, 0),
    (256, 64, 56, 1, 1, 0), (256, 128, 56, 1, 1, 0), (128, 128, 56, 3, 2, 1), (128, 512, 28, 1, 1, 0),
    (256, 512, 56, 1, 2, 0), (512, 128, 28, 1, 1, 0), (128, 128, 28, 3, 1, 1), (512, 256, 28, 1, 1, 0),
    (256, 256, 28, 3, 2, 1), (256, 1024, 14, 1, 1, 0), (512, 1024, 28, 1, 2, 0), (1024, 256, 14, 1, 1, 0),
    (256, 256, 14, 3, 1, 1), (1024, 512, 14, 1, 1, 0), (512, 512, 14, 3, 2, 1), (512, 2048, 7, 1, 1, 0),
    (1024, 2048, 14, 1, 2, 0), (2048, 512, 7, 1, 1, 0), (512, 512, 7, 3, 1, 1),
]


@dataclass(frozen=True, kw_only=True)
class KernelsPlan:
    gemm_sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    conv_batches: tuple[int, ...] = (1, 8)
    convs: tuple[tuple[int, ...], ...] = tuple(RESNET50_CONVS)
    threads: tuple[int, ...] = (1, 2)
    machine_seconds: float = 0.3
    top_k: int = 5
    repeats: int = 5
    tvm_trials: int = 32  # MetaSchedule's measured candidates per shape (about a minute a shape here)
    tvm_gemm_sizes: tuple[int, ...] = (1024,)
    tvm_convs: tuple[int, ...] = (2,)  # indices into convs, batch 1, 1 thread
    validation: tuple[str, ...] = ("gemm:512", "conv:2", "conv:12")
    validation_samples: int = 12
    train_steps: int = 150


FULL = KernelsPlan()
QUICK = KernelsPlan(
    gemm_sizes=(128, 256), conv_batches=(1,), convs=((64, 64, 14, 3, 1, 1), (128, 256, 14, 1, 2, 0)),
    machine_seconds=0.05, top_k=3, repeats=3, tvm_trials=8, tvm_gemm_sizes=(), tvm_convs=(),  # TVM: > 2 min alone
    validation=("gemm:256",), validation_samples=6, train_steps=4,
)


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
    cin, cout, size, k, stride, pad = spec
    return ops.Conv2dShape(batch=batch, in_channels=cin, out_channels=cout, height=size, width=size,
                           kernel=(k, k), stride=(stride, stride), padding=(pad, pad))


def _cases(plan: KernelsPlan):
    for n in plan.gemm_sizes:
        yield "gemm", f"{n}^3", ops.gemm(n, n, n), (n, n, n), 2.0 * n**3
    for batch in plan.conv_batches:
        for i, spec in enumerate(plan.convs):
            s = _conv_shape(spec, batch)
            yield "conv", f"#{i} {s.label()}", ops.conv2d(s), s, float(s.flops)


def _min_bytes(op) -> float:
    return 4.0 * (op.output.tensor.numel + sum(t.numel for t in op.inputs))


def _measure_case(kind, label, op, spec, flops, threads, plan, machine) -> dict:
    tuned = tune(op, threads=threads, machine=machine, top_k=plan.top_k, repeats=plan.repeats)
    kernel = compile_kernel(op, tuned.best)
    inputs = random_inputs(op)
    seconds = _median_seconds(lambda: kernel(*inputs, threads=threads), plan.repeats)
    row = {
        "kind": kind, "shape": label, "threads": threads, "gflops": round(flops / seconds / GIGA, 2),
        "seconds": seconds, "predicted_s": predict(op, tuned.best, machine, threads),
        "schedule": tuned.best.short(), "tuning_s": round(tuned.wall_seconds, 2), "space": tuned.space_size,
        "measured_candidates": len(tuned.trials), "spearman": round(tuned.spearman, 3),
        "intensity": flops / _min_bytes(op), "flops": flops,
        "trials": [{"schedule": t.schedule.short(), "predicted_s": t.predicted, "measured_s": t.measured}
                   for t in tuned.trials],
    }
    runners = {"torch": anchors.torch_gemm if kind == "gemm" else anchors.torch_conv,
               "numpy": anchors.numpy_gemm if kind == "gemm" else anchors.numpy_conv}
    for name, make in runners.items():
        call = make(*spec, threads) if kind == "gemm" else make(spec, threads)
        row[f"{name}_gflops"] = round(flops / _median_seconds(call, plan.repeats) / GIGA, 2)
    return row


def _tvm_rows(plan: KernelsPlan, rows: list[dict], progress: bool) -> str | None:
    """TVM MetaSchedule on a few of the shapes (1 thread): its tuned speed and tuning time."""
    status = anchors.tvm_status()
    if status is not None:
        return status
    by_key = {(r["kind"], r["shape"], r["threads"]): r for r in rows}
    jobs = [("gemm", f"{n}^3", (n, n, n), 2.0 * n**3) for n in plan.tvm_gemm_sizes]
    for i in plan.tvm_convs:
        s = _conv_shape(plan.convs[i], plan.conv_batches[0])
        jobs.append(("conv", f"#{i} {s.label()}", s, float(s.flops)))
    errors = []
    for kind, label, spec, flops in tqdm(jobs, desc="tvm", disable=not progress):
        row = by_key.get((kind, label, 1))
        if row is None:
            continue
        got = anchors.tvm_measure(kind, spec, 1, plan.tvm_trials, plan.repeats)
        if "error" in got:
            row["tvm_error"] = got["error"]
            errors.append(f"{label}: {got['error']}")
            continue
        row["tvm_gflops"] = round(flops / got["seconds"] / GIGA, 2)
        row["tvm_tuning_s"] = round(got["tuning_s"], 1)
        row["tvm_tuned"] = got["tuned"]
        row["tvm_trials"] = plan.tvm_trials
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


def _headline(rows, machine, validation, tvm_note, curves) -> dict:
    anchors_of = ("torch_gflops", "numpy_gflops", "tvm_gflops")
    wins = [r["gflops"] >= 0.95 * max(r.get(a, 0.0) for a in anchors_of) for r in rows]
    for r, w in zip(rows, wins, strict=True):
        r["best_anchor_gflops"] = max(r.get(a, 0.0) for a in anchors_of)
        r["vs_best_anchor"] = round(r["gflops"] / r["best_anchor_gflops"], 3)
        r["win"] = w
    gemm1 = [r for r in rows if r["kind"] == "gemm" and r["threads"] == 1]
    top = next((r for r in gemm1 if r["shape"] == "2048^3"), gemm1[-1] if gemm1 else None)
    peak = machine.peak(1)
    rhos = [r["spearman"] for r in rows if r["spearman"] == r["spearman"]]  # nan: fewer than 3 candidates
    h = {
        "peak_gflops_1_thread": round(peak / GIGA, 2),
        "isa": machine.isa,
        f"sgemm_{top['shape'].split('^')[0]}_fraction_of_peak_1_thread" if top else "sgemm": (
            round(top["gflops"] * GIGA / peak, 3) if top else None),
        "win_fraction_vs_best_anchor": round(sum(wins) / len(wins), 3),
        "shapes": len(rows),
        "tuning_seconds_per_shape_median": round(statistics.median(r["tuning_s"] for r in rows), 2),
        "tuning_seconds_per_shape_max": round(max(r["tuning_s"] for r in rows), 2),
        "spearman_shortlist_median": round(statistics.median(rhos), 3) if rhos else None,
        "spearman_validation": [v["spearman"] for v in validation],
    }
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
    else:
        h["tvm"] = f"absent: {tvm_note}" if tvm_note else "not run: this plan has no TVM shapes"
    if curves:
        h["train_max_loss_gap"] = curves["max_abs_gap"]
    return h


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
    rows = []
    cases = [(c, t) for c in _cases(plan) for t in plan.threads]
    for (kind, label, op, spec, flops), threads in tqdm(cases, desc="bench kernels", disable=not progress):
        rows.append(_measure_case(kind, label, op, spec, flops, threads, plan, machine))
    tvm_note = _tvm_rows(plan, rows, progress)
    validation = _validation(plan, machine)
    curves = train_curves(plan.train_steps)
    from tessera.bench.machine import machine_rows

    headline = _headline(rows, machine, validation, tvm_note, curves)
    notes = [
        f"Tessera: tuned in the run (the model ranks the whole space, the best {plan.top_k} predicted plus the best "
        f"of the other lowering are compiled and timed, median of up to {plan.repeats}); anchors: median of repeats.",
        "numpy's conv is im2col (sliding windows of the padded input) + one matmul per group.",
        f"TVM: MetaSchedule, {plan.tvm_trials} trials per shape, target llvm -mcpu={tvm_mcpu()}, 1 thread; "
        + ("its tuning time is recorded per shape." if tvm_note is None else f"not run: {tvm_note}."),
        "A win: Tessera >= 0.95x the best anchor measured for that shape and thread count.",
        f"Whole run {time.perf_counter() - began:.0f} s on {machine.cores} cores.",
    ]
    columns = ["kind", "shape", "threads", "gflops", "torch_gflops", "numpy_gflops", "tvm_gflops",
               "vs_best_anchor", "tuning_s", "tvm_tuning_s", "spearman", "schedule"]
    tables = [("Machine", ["what", "threads", "value", "unit"], machine_rows(machine)),
              ("Model validation (schedules spread over the ranked space)", ["case", "space", "samples", "spearman"],
               validation)]
    if curves:
        tables.append(("ResNet-8 on digits: Tessera kernels vs torch", ["step", "torch", "tessera", "gap"],
                       curves["table"]))
    return BenchResult(name="kernels", headline=headline, rows=rows, columns=columns, notes=notes, tables=tables,
                       extra={"machine_parameters": machine.to_json(), "validation": validation, "training": curves})


# ---- swCaffe's point: a CNN trained on Tessera's kernels -----------------------------------
def resnet8(num_classes: int = 10):
    """A ResNet-8 (stem + three basic blocks of widths 16/32/64) for 1-channel 16x16 digits."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
            return (y + (x if self.down is None else self.down(x))).relu()

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes),
    )


def digit_batches(steps: int, batch: int = 64, seed: int = 0):
    """The bundled digits upsampled to 16x16, in a fixed shuffled order of batches."""
    import torch
    import torch.nn.functional as F

    from tessera.data.digits import load_digits_images

    images, labels = load_digits_images()
    images = F.interpolate(images, size=(16, 16), mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < steps:
        order = torch.randperm(len(images), generator=g)
        out += [(images[order[i:i + batch]], labels[order[i:i + batch]])
                for i in range(0, len(images) - batch + 1, batch)]
    return out[:steps]


def train_pair(steps: int, *, batch: int = 64, lr: float = 0.05):
    """Losses of the same ResNet-8 (same init, same batches) trained with torch's ops and with
    every conv and linear forward and backward on Tessera's kernels."""
    import copy

    import torch

    from tessera.kernels.nn import convert

    torch.manual_seed(0)
    ref = resnet8()
    mine = convert(copy.deepcopy(ref))
    losses = {"torch": [], "tessera": []}
    for name, model in (("torch", ref), ("tessera", mine)):
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        for x, y in digit_batches(steps, batch):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    return losses


def train_curves(steps: int) -> dict:
    began = time.perf_counter()
    losses = train_pair(steps)
    gaps = [abs(a - b) for a, b in zip(losses["torch"], losses["tessera"], strict=True)]
    every = max(1, steps // 10)
    table = [{"step": i, "torch": round(losses["torch"][i], 5), "tessera": round(losses["tessera"][i], 5),
              "gap": f"{gaps[i]:.2e}"} for i in list(range(0, steps, every)) + [steps - 1]]
    return {"steps": steps, "losses": losses, "max_abs_gap": max(gaps), "table": table,
            "seconds": round(time.perf_counter() - began, 1)}


def plot_kernels(result: BenchResult, path: Path) -> None:
    from tessera.bench.machine import plot_roofline

    plot_roofline(result, path)
