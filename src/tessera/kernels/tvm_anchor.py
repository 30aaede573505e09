"""Apache TVM's MetaSchedule as an anchor (optional extra ``tessera[tvm]``): the operator
written in TE, tuned by MetaSchedule for LLVM code on this CPU, the best schedule built and
timed. Besides the final time it records the tuning curve: after every batch of measured
candidates, the trials so far, the tuning seconds so far and the best time MetaSchedule's
own runner has measured so far (its mean over the runner's repeats).

A tuning of a thousand trials takes about an hour a shape on this machine, so a finished
tuning is kept (``cache``: MetaSchedule's database, its curve and tuning time, under a key of
the operator, target, threads, trial budget and TVM version), as a deployment keeps TVM's
tuning log; a later run builds the best schedule from it and times it in that run, and the
row says the tuning was reused and when it ran. A tuning is written to a temporary folder and
renamed only once complete: an interrupted one leaves nothing behind."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from tessera.kernels.ops import Conv2dShape

# TVM's "Auto-scheduling a Neural Network for x86 CPU" tutorial (Ansor, MetaSchedule's
# predecessor) recommends about 800 measured trials per task, "typically enough for the
# search to converge"; the benchmark's default is 1000 a shape.
DOCUMENTED_CPU_TRIALS = 1000
# TVM's best is timed for at least ``repeats`` calls and this long (the median of the calls): a
# 27 ms operator timed three times once measured 40 GFLOP/s where MetaSchedule's runner had 76
MIN_TIMED_S = 1.0


def tvm_status() -> str | None:
    """None when TVM is importable, else why not (the benchmark reports it)."""
    if importlib.util.find_spec("tvm") is None:
        return "apache-tvm is not installed (pip install -c constraints.txt -e '.[tvm]')"
    try:
        import tvm  # noqa: F401
        from tvm.s_tir import meta_schedule  # noqa: F401
    except Exception as exc:  # an import-time failure of the optional extra is reported, not raised
        return f"apache-tvm does not import: {type(exc).__name__}: {exc}"
    return None


def _rng_inputs(*shapes):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s, dtype=np.float32) for s in shapes]


def _gemm_module(m: int, n: int, k: int):
    from tvm import te

    a = te.placeholder((m, k), name="A", dtype="float32")
    b = te.placeholder((k, n), name="B", dtype="float32")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    return te.create_prim_func([a, b, c]), [(m, k), (k, n)], (m, n)


def _conv_module(s: Conv2dShape):
    from tvm import te, topi

    x = te.placeholder(s.input_shape, name="X", dtype="float32")
    w = te.placeholder(s.weight_shape, name="W", dtype="float32")
    if s.groups == 1:
        y = topi.nn.conv2d_nchw(x, w, s.stride, s.padding, 1, out_dtype="float32")
    else:
        y = topi.nn.group_conv2d_nchw(x, w, s.stride, s.padding, 1, s.groups, out_dtype="float32")
    return te.create_prim_func([x, w, y]), [s.input_shape, s.weight_shape], s.output_shape


def tvm_mcpu() -> str:
    """LLVM's CPU for TVM: the widest ISA Tessera's kernels use here too."""
    from tessera.kernels.machine import cpu_isas

    return "skylake-avx512" if "avx512" in cpu_isas() else "core-avx2"


def _target(threads: int):
    import tvm

    return tvm.target.Target({"kind": "llvm", "mcpu": tvm_mcpu(), "num-cores": threads})


def _curve_callback(curve: list[dict], began: float):
    """A MeasureCallback appending (trials, seconds, best so far) after every measured batch."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    @derived_object
    class Curve(PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            times = [
                float(np.mean([float(t) for t in r.run_secs]))
                for r in runner_results
                if r.error_msg is None and r.run_secs
            ]
            earlier = [curve[-1]["best_s"]] if curve and curve[-1]["best_s"] is not None else []
            best = min([*times, *earlier], default=None)  # None: nothing has run correctly yet
            trials = (curve[-1]["trials"] if curve else 0) + len(runner_results)
            curve.append(
                {"trials": trials, "tuning_s": round(time.perf_counter() - began, 2), "best_s": best}
            )

    return Curve()


def default_cache() -> str:
    """Where the benchmark keeps finished tunings: ``$TESSERA_TVM_CACHE`` or ~/.cache/tessera/tvm."""
    return os.environ.get("TESSERA_TVM_CACHE") or str(Path.home() / ".cache" / "tessera" / "tvm")


def cache_key(kind: str, spec, threads: int, trials: int) -> str:
    """The folder name of one tuning: operator, target, threads, trials and TVM's version."""
    import tvm

    what = json.dumps([kind, repr(spec), tvm_mcpu(), threads, trials, tvm.__version__])
    return f"{kind}-{hashlib.sha256(what.encode()).hexdigest()[:16]}"


def _tune(func, target, threads: int, trials: int, work_dir: str) -> tuple[dict, object]:
    """MetaSchedule's tuning into ``work_dir``: ({tuning_s, curve}, the database)."""
    from tvm.s_tir import meta_schedule as ms

    curve: list[dict] = []
    began = time.perf_counter()
    # generous build/run timeouts: on a loaded 2-core machine a worker's start alone can pass 30 s
    database = ms.tune_tir(
        mod=func,
        target=target,
        work_dir=work_dir,
        max_trials_global=trials,
        num_trials_per_iter=min(64, trials),
        builder=ms.builder.LocalBuilder(timeout_sec=300),
        runner=ms.runner.LocalRunner(timeout_sec=120),
        measure_callbacks=[
            *ms.measure_callback.MeasureCallback.create("default"),
            _curve_callback(curve, began),
        ],
        num_tuning_cores=threads,
    )
    return {"tuning_s": time.perf_counter() - began, "curve": curve}, database


def _tune_and_time(kind: str, spec, threads: int, trials: int, repeats: int, cache: str | None = None) -> dict:
    """In a child process: tune with MetaSchedule (``trials`` measured candidates) or take the
    tuning kept in ``cache``, build the best, time it (the median of at least ``repeats`` calls and
    ``MIN_TIMED_S`` seconds of them, after a warm-up)."""
    import statistics

    os.environ["TVM_NUM_THREADS"] = str(threads)
    import tvm
    from tvm.s_tir import meta_schedule as ms

    func, in_shapes, out_shape = _gemm_module(*spec) if kind == "gemm" else _conv_module(spec)
    target = _target(threads)
    kept = Path(cache) / cache_key(kind, spec, threads, trials) if cache else None
    if cache:
        os.makedirs(cache, exist_ok=True)
    if kept is not None and (kept / "meta.json").exists():
        meta = json.loads((kept / "meta.json").read_text())
        database = ms.database.JSONDatabase(work_dir=str(kept), allow_missing=False)
        sch = ms.tir_integration.compile_tir(database, func, target)
    else:
        tmp = tempfile.mkdtemp(dir=cache)
        try:
            meta, database = _tune(func, target, threads, trials, tmp)
            sch = ms.tir_integration.compile_tir(database, func, target)
            if kept is not None:
                meta["tuned_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
                Path(tmp, "meta.json").write_text(json.dumps(meta))
                shutil.rmtree(kept, ignore_errors=True)
                os.replace(tmp, kept)  # complete, or not there at all
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when it became the kept tuning
        meta["reused"] = False
    curve = meta["curve"]
    lib = tvm.compile(sch.mod if sch is not None else func, target=target)
    dev = tvm.cpu(0)
    args = [tvm.runtime.tensor(x, dev) for x in _rng_inputs(*in_shapes)]
    args.append(tvm.runtime.tensor(np.empty(out_shape, np.float32), dev))
    fn = lib["main"]
    fn(*args)
    times, total = [], 0.0
    while len(times) < repeats or total < MIN_TIMED_S:  # a moment of the VM's is not its speed
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
        total += times[-1]  # a running sum: a microsecond operator takes ~10^6 calls to fill 1 s
    return {
        "seconds": statistics.median(times),
        "tuning_s": meta["tuning_s"],
        "tuning_reused": meta.get("reused", True),
        "tuned_at": meta.get("tuned_at"),
        "tuned": sch is not None,
        "measured_trials": curve[-1]["trials"] if curve else 0,
        "curve": curve,
        "code_path": f"LLVM {tvm.target.codegen.llvm_version_major()} -mcpu={tvm_mcpu()}, TVM {tvm.__version__}",
    }


def tvm_measure(kind: str, spec, threads: int, trials: int, repeats: int = 5, cache: str | None = None) -> dict:
    """TVM's tuned time of one operator and its tuning curve, run in a fresh child process
    (TVM's thread pool and its crashes stay out of ours); {"error": why} when it fails.
    ``cache``: a folder where finished tunings are kept and reused (None: tune every time)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(_tune_and_time, kind, spec, threads, trials, repeats, cache).result()
    except Exception as exc:  # a failing optional anchor is reported in the results, not raised
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]}
