"""The same operators in other libraries, as the benchmark's anchors, each at its best:

- GEMM: OpenBLAS and BLIS through ctypes (``blas_libs``: the kernel set of the widest ISA
  here), torch through MKL (``torch.mm``; and MKL's packed SGEMM, the weight packed once as
  torch's own compiler does for a float32 ``Linear``) and through oneDNN (its matmul on a
  weight reordered once into oneDNN's blocked layout);
- convolution: torch's default dispatch (which sends some shapes to its im2col path), oneDNN
  forced (``torch.mkldnn_convolution``) and oneDNN on a weight reordered once;
- numpy, only as a sanity row (its own OpenBLAS; a convolution as im2col + matmul);
- Apache TVM MetaSchedule lives in ``tvm_anchor``.

Every factory returns a ``Runner``: ``call`` runs the operator once on fixed random inputs;
``threads`` is entered once around a timing loop and sets the library's thread count
(nothing about threads happens inside ``call``). A path that cannot run here raises
``AnchorAbsent`` with the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tessera.kernels.blas_libs import AnchorAbsent, BlasLibrary
from tessera.kernels.kernel import aligned_normal
from tessera.kernels.ops import Conv2dShape

__all__ = [
    "AnchorAbsent",
    "Runner",
    "TORCH_GEMM_PATHS",
    "TORCH_CONV_PATHS",
    "blas_gemm",
    "numpy_gemm",
    "numpy_conv",
    "torch_gemm",
    "torch_conv",
]


@dataclass(frozen=True)
class Runner:
    call: Callable[[], object]
    threads: Callable[[], contextlib.AbstractContextManager]


def _rng_inputs(*shapes):
    """The anchors' inputs: the same draws as Tessera's (``random_inputs``), on cache lines."""
    return aligned_normal(shapes, 0)


# ---- torch -------------------------------------------------------------------------------
def _torch_threads(threads: int):
    @contextlib.contextmanager
    def enter():
        import torch

        old = torch.get_num_threads()
        torch.set_num_threads(threads)  # MKL's and oneDNN's OpenMP pool alike
        try:
            yield
        finally:
            torch.set_num_threads(old)

    return enter


def _need_onednn():
    import torch

    if not torch.backends.mkldnn.is_available():
        raise AnchorAbsent("torch was built without oneDNN (torch.backends.mkldnn.is_available() is False)")


def _gemm_mkl(a, b, out, m):
    import torch

    return lambda: torch.mm(a, b, out=out)


def _gemm_mkl_packed(a, b, out, m):
    import torch

    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        raise AnchorAbsent("torch was built without MKL's packed SGEMM (torch.ops.mkl._mkl_linear)")
    w = b.t().contiguous()  # a Linear's weight, [n, k]
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
    return lambda: torch.ops.mkl._mkl_linear(a, packed, w, None, m)


def _gemm_onednn(a, b, out, m):
    import torch

    _need_onednn()
    packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), m)
    return lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")


TORCH_GEMM_PATHS = {"mkl": _gemm_mkl, "mkl_packed": _gemm_mkl_packed, "onednn": _gemm_onednn}


def torch_gemm(m: int, n: int, k: int, threads: int, path: str = "mkl") -> Runner:
    """C[m, n] = A[m, k] B[k, n] through ``path`` (a key of TORCH_GEMM_PATHS)."""
    import torch

    if path not in TORCH_GEMM_PATHS:
        raise ValueError(f"unknown torch GEMM path {path!r}; expected one of {sorted(TORCH_GEMM_PATHS)}")
    a, b = (torch.from_numpy(x) for x in _rng_inputs((m, k), (k, n)))
    with _torch_threads(threads)():  # weight packing may run threads too
        call = TORCH_GEMM_PATHS[path](a, b, torch.empty(m, n), m)
    return Runner(call, _torch_threads(threads))  # no input requires grad: no autograd work


def _conv_default(s, x, w):
    import torch.nn.functional as F

    return lambda: F.conv2d(x, w, stride=s.stride, padding=s.padding, groups=s.groups)


def _conv_onednn(s, x, w):
    import torch

    _need_onednn()
    return lambda: torch.mkldnn_convolution(x, w, None, s.padding, s.stride, (1, 1), s.groups)


def _conv_onednn_packed(s, x, w):
    import torch

    _need_onednn()
    packed = torch._C._nn.mkldnn_reorder_conv2d_weight(
        w.to_mkldnn(), list(s.padding), list(s.stride), [1, 1], s.groups, list(s.input_shape)
    )
    pad, stride = list(s.padding), list(s.stride)
    return lambda: torch.ops.mkldnn._convolution_pointwise(
        x, packed, None, pad, stride, [1, 1], s.groups, "none", [], ""
    )


TORCH_CONV_PATHS = {"default": _conv_default, "onednn": _conv_onednn, "onednn_packed": _conv_onednn_packed}


def torch_conv(s: Conv2dShape, threads: int, path: str = "default") -> Runner:
    """The convolution through ``path`` (a key of TORCH_CONV_PATHS)."""
    import torch

    if path not in TORCH_CONV_PATHS:
        raise ValueError(f"unknown torch conv path {path!r}; expected one of {sorted(TORCH_CONV_PATHS)}")
    x, w = (torch.from_numpy(v) for v in _rng_inputs(s.input_shape, s.weight_shape))
    with _torch_threads(threads)():
        call = TORCH_CONV_PATHS[path](s, x, w)
    return Runner(call, _torch_threads(threads))  # no input requires grad: no autograd work


# ---- OpenBLAS / BLIS through ctypes ------------------------------------------------------
def blas_gemm(lib: BlasLibrary, m: int, n: int, k: int, threads: int) -> Runner:
    if lib.max_threads is not None and threads > lib.max_threads:
        raise AnchorAbsent(f"{lib.name}: this build is single-threaded ({lib.code_path.get('library')})")
    a, b = _rng_inputs((m, k), (k, n))
    c = np.empty((m, n), np.float32)

    @contextlib.contextmanager
    def enter():
        lib.set_threads(threads)
        yield

    return Runner(lib.prepare(a, b, c), enter)


# ---- numpy (a sanity row) ----------------------------------------------------------------
def _blas_threads(threads: int):
    def enter():
        from threadpoolctl import threadpool_limits

        return threadpool_limits(limits=threads, user_api="blas")

    return enter


def numpy_gemm(m: int, n: int, k: int, threads: int) -> Runner:
    a, b = _rng_inputs((m, k), (k, n))
    out = np.empty((m, n), np.float32)
    return Runner(lambda: np.matmul(a, b, out=out), _blas_threads(threads))


def numpy_conv(s: Conv2dShape, threads: int) -> Runner:
    """im2col by sliding windows over the zero-padded input, then one matmul per group."""
    x, w = _rng_inputs(s.input_shape, s.weight_shape)
    (ph, pw), (sh, sw), g = s.padding, s.stride, s.groups
    cig, cog = s.in_channels // g, s.out_channels // g
    wg = w.reshape(g, cog, -1)

    def call():
        xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
        win = np.lib.stride_tricks.sliding_window_view(xp, s.kernel, axis=(2, 3))[:, :, ::sh, ::sw]
        win = win[:, :, : s.out_height, : s.out_width]  # (n, c, oh, ow, kh, kw)
        cols = win.reshape(s.batch, g, cig, s.out_height, s.out_width, -1).transpose(0, 1, 2, 5, 3, 4)
        cols = cols.reshape(s.batch, g, cig * s.kernel[0] * s.kernel[1], -1)
        return np.matmul(wg[None], cols)

    return Runner(call, _blas_threads(threads))
