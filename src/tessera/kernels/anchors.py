"""The same operators in other libraries, as the benchmark's anchors: torch (its CPU BLAS
for GEMM, oneDNN for convolution), numpy (its BLAS; a convolution as im2col + matmul) and
Apache TVM's MetaSchedule (optional extra ``tessera[tvm]``; LLVM code it tunes itself).
Each ``*_runner`` returns a no-argument callable that runs the operator once on fixed
random inputs, at the thread count it was built for."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np

from tessera.kernels.ops import Conv2dShape


def _rng_inputs(*shapes):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s, dtype=np.float32) for s in shapes]


def torch_gemm(m: int, n: int, k: int, threads: int) -> Callable[[], object]:
    import torch

    a, b = (torch.from_numpy(x) for x in _rng_inputs((m, k), (k, n)))
    out = torch.empty(m, n)

    def call():
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        torch.mm(a, b, out=out)
        torch.set_num_threads(old)

    return call


def torch_conv(s: Conv2dShape, threads: int) -> Callable[[], object]:
    import torch
    import torch.nn.functional as F

    x, w = (torch.from_numpy(v) for v in _rng_inputs(s.input_shape, s.weight_shape))

    def call():
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        with torch.no_grad():
            F.conv2d(x, w, stride=s.stride, padding=s.padding, groups=s.groups)
        torch.set_num_threads(old)

    return call


@contextlib.contextmanager
def _blas_threads(threads: int):
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=threads, user_api="blas"):
        yield


def numpy_gemm(m: int, n: int, k: int, threads: int) -> Callable[[], object]:
    a, b = _rng_inputs((m, k), (k, n))
    out = np.empty((m, n), np.float32)

    def call():
        with _blas_threads(threads):
            np.matmul(a, b, out=out)

    return call


def numpy_conv(s: Conv2dShape, threads: int) -> Callable[[], object]:
    """im2col by sliding windows over the zero-padded input, then one matmul per group."""
    x, w = _rng_inputs(s.input_shape, s.weight_shape)
    (ph, pw), (sh, sw), g = s.padding, s.stride, s.groups
    cig, cog = s.in_channels // g, s.out_channels // g
    wg = w.reshape(g, cog, -1)

    def call():
        with _blas_threads(threads):
            xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
            win = np.lib.stride_tricks.sliding_window_view(xp, s.kernel, axis=(2, 3))[:, :, ::sh, ::sw]
            win = win[:, :, : s.out_height, : s.out_width]  # (n, c, oh, ow, kh, kw)
            cols = win.reshape(s.batch, g, cig, s.out_height, s.out_width, -1).transpose(0, 1, 2, 5, 3, 4)
            cols = cols.reshape(s.batch, g, cig * s.kernel[0] * s.kernel[1], -1)
            return np.matmul(wg[None], cols)

    return call


# ---- Apache TVM MetaSchedule -------------------------------------------------------------
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


def _tvm_gemm_module(m: int, n: int, k: int):
    from tvm import te

    a = te.placeholder((m, k), name="A", dtype="float32")
    b = te.placeholder((k, n), name="B", dtype="float32")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    return te.create_prim_func([a, b, c]), [(m, k), (k, n)], (m, n)


def _tvm_conv_module(s: Conv2dShape):
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


def _tvm_target(threads: int):
    import tvm

    return tvm.target.Target({"kind": "llvm", "mcpu": tvm_mcpu(), "num-cores": threads})


def _tvm_tune_and_time(kind: str, spec, threads: int, trials: int, repeats: int) -> dict:
    """In a child process: tune with MetaSchedule (``trials`` measured candidates), build the
    best, time it (median of ``repeats`` after a warm-up)."""
    import statistics

    os.environ["TVM_NUM_THREADS"] = str(threads)
    import tvm
    from tvm.s_tir import meta_schedule as ms

    func, in_shapes, out_shape = _tvm_gemm_module(*spec) if kind == "gemm" else _tvm_conv_module(spec)
    target = _tvm_target(threads)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # generous build/run timeouts: on a loaded 2-core machine a worker's start alone can pass 30 s
        database = ms.tune_tir(
            mod=func, target=target, work_dir=tmp, max_trials_global=trials, num_trials_per_iter=min(16, trials),
            builder=ms.builder.LocalBuilder(timeout_sec=300), runner=ms.runner.LocalRunner(timeout_sec=120),
            num_tuning_cores=threads,
        )
        sch = ms.tir_integration.compile_tir(database, func, target)
    tuning = time.perf_counter() - began
    lib = tvm.compile(sch.mod if sch is not None else func, target=target)
    dev = tvm.cpu(0)
    args = [tvm.runtime.tensor(x, dev) for x in _rng_inputs(*in_shapes)]
    args.append(tvm.runtime.tensor(np.empty(out_shape, np.float32), dev))
    fn = lib["main"]
    fn(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "tuning_s": tuning, "tuned": sch is not None}


def tvm_measure(kind: str, spec, threads: int, trials: int, repeats: int = 5) -> dict:
    """TVM's tuned time of one operator, run in a fresh child process (TVM's thread pool and
    its crashes stay out of ours); {"error": why} when it fails."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(_tvm_tune_and_time, kind, spec, threads, trials, repeats).result()
    except Exception as exc:  # a failing optional anchor is reported in the results, not raised
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]}
