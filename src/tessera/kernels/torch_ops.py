"""Tessera's kernels as torch.library custom ops: ``tessera::matmul``, ``tessera::bmm``,
``tessera::conv2d`` and the conv's two gradient ops. Each has a fake (meta) kernel, so it
traces under FakeTensorMode / torch.compile, and the differentiable ones an autograd
formula whose backward runs operators of the same DSL (GEMMs with other transpositions,
the conv's weight gradient, its column gradient + col2im or the direct scatter).

Kernels are chosen per shape and thread count (``torch.get_num_threads()``) by the tuner
(``set_tuning("model")``, the default: the model's pick, compiled once; ``"measure"``:
timed candidates) and kept for the process. Inputs must be float32 CPU tensors; anything
else is a ValueError, never a silent fall back to torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from tessera.kernels import ops
from tessera.kernels.ir import Operator
from tessera.kernels.kernel import Kernel, compile_kernel
from tessera.kernels.machine import load_machine
from tessera.kernels.model import predict
from tessera.kernels.tuner import MODES, best_schedule

_TUNING = {"mode": "model"}
_KERNELS: dict[tuple[str, int], Kernel] = {}


def set_tuning(mode: str) -> None:
    """How new shapes get their schedule: "model" (predicted best) or "measure" (tuned)."""
    if mode not in MODES:
        raise ValueError(f"tuning mode {mode!r}; choose one of {', '.join(MODES)}")
    _TUNING["mode"] = mode


def kernel_for(op: Operator, threads: int | None = None) -> Kernel:
    threads = threads or torch.get_num_threads()
    key = (op.signature(), threads)
    if key not in _KERNELS:
        _KERNELS[key] = compile_kernel(op, best_schedule(op, threads=threads, mode=_TUNING["mode"]))
    return _KERNELS[key]


def _args(op: Operator, named: dict[str, Tensor]) -> list[Tensor]:
    return [named[t.name].contiguous().view(t.shape) for t in op.inputs]


def run(op: Operator, named: dict[str, Tensor]) -> Tensor:
    """Run ``op`` on tensors given by the names of its inputs (reshaped to the IR's shapes)."""
    threads = torch.get_num_threads()
    return kernel_for(op, threads)(*_args(op, named), threads=threads)


PACKED_SHAPES = 4  # packed copies of its weight a layer keeps, one per input shape met last


def _run_weight_packed(op: Operator, named: dict[str, Tensor], weight: str, cache: OrderedDict) -> Tensor:
    """``run`` for inference with a layer's weight (input ``weight``) packed once and kept in
    ``cache`` (the layer's) while the weight's storage and version stay the same: the packing
    follows the schedule, which follows the input's shape, so the cache holds the last
    ``PACKED_SHAPES`` shapes' (a server's changing batch sizes do not pile up copies). A
    schedule that cannot take a packed weight runs as ``run`` does. Sums and their order are
    those of packing per call, so the bits are too."""
    threads = torch.get_num_threads()
    kernel = kernel_for(op, threads)
    index = [t.name for t in op.inputs].index(weight)
    args = _args(op, named)
    if kernel.prepack_operand(index) is None:
        return kernel(*args, threads=threads)
    w = named[weight]
    stamp, key = (w.data_ptr(), w._version), (op.signature(), threads)
    kept = cache.get(key)
    if kept is None or kept[0] != stamp:
        kept = cache[key] = (stamp, kernel.prepack(index, args[index]))
        while len(cache) > PACKED_SHAPES:
            cache.popitem(last=False)
    cache.move_to_end(key)
    return kernel.run_prepacked(kept[1], *args, threads=threads)


def matmul_weight_packed(a: Tensor, weight: Tensor, cache: OrderedDict) -> Tensor:
    """``matmul(a, weight, False, True)`` (a Linear's) for inference, the weight kept packed in
    ``cache`` (``_run_weight_packed``); the same checks as ``matmul``."""
    _check("matmul", a=a, b=weight)
    if a.dim() != 2:
        raise ValueError(f"tessera::matmul takes 2-D tensors, got {a.dim()}-D")
    m, n, k = _gemm_sizes(a, weight, False, True, "matmul")
    return _run_weight_packed(ops.gemm(m, n, k, trans_b=True), {"A": a, "B": weight}, "B", cache)


def conv2d_weight_packed(x: Tensor, weight: Tensor, stride: Sequence[int], padding: Sequence[int], groups: int,
                         cache: OrderedDict) -> Tensor:
    """``conv2d`` for inference, the weight kept packed in ``cache``; the same checks."""
    _check("conv2d", input=x, weight=weight)
    _dims(x, weight)
    s = conv_shape(x.shape, weight.shape, stride, padding, groups)
    return _run_weight_packed(ops.conv2d(s), {"X": x, "W": weight}, "W", cache).view(s.output_shape)


def _check(op_name: str, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise ValueError(f"tessera::{op_name}: {name} has dtype {t.dtype}; Tessera's kernels take float32")
        if t.device.type != "cpu":
            raise ValueError(f"tessera::{op_name}: {name} is on {t.device}; Tessera's kernels run on the CPU")


def _gemm_sizes(a: Tensor, b: Tensor, trans_a: bool, trans_b: bool, name: str) -> tuple[int, int, int]:
    if a.dim() != b.dim():
        raise ValueError(f"tessera::{name}: operands have {a.dim()} and {b.dim()} dimensions")
    m, k = (a.shape[-1], a.shape[-2]) if trans_a else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], b.shape[-2]) if trans_b else (b.shape[-2], b.shape[-1])
    if k != kb:
        raise ValueError(f"tessera::{name}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply "
                         f"(trans_a={trans_a}, trans_b={trans_b}: inner sizes {k} and {kb})")
    return m, n, k


# ---- matmul / bmm ------------------------------------------------------------------------
@torch.library.custom_op("tessera::matmul", mutates_args=())
def matmul(a: Tensor, b: Tensor, trans_a: bool = False, trans_b: bool = False) -> Tensor:
    """op(a) @ op(b) for 2-D float32 tensors; op transposes when asked (no copy is made)."""
    _check("matmul", a=a, b=b)
    if a.dim() != 2:
        raise ValueError(f"tessera::matmul takes 2-D tensors, got {a.dim()}-D")
    m, n, k = _gemm_sizes(a, b, trans_a, trans_b, "matmul")
    return run(ops.gemm(m, n, k, trans_a=trans_a, trans_b=trans_b), {"A": a, "B": b})


@matmul.register_fake
def _(a, b, trans_a=False, trans_b=False):
    m, n, _ = _gemm_sizes(a, b, trans_a, trans_b, "matmul")
    return a.new_empty((m, n))


@torch.library.custom_op("tessera::bmm", mutates_args=())
def bmm(a: Tensor, b: Tensor, trans_a: bool = False, trans_b: bool = False) -> Tensor:
    """Batched op(a) @ op(b) for 3-D float32 tensors of one batch size."""
    _check("bmm", a=a, b=b)
    if a.dim() != 3 or a.shape[0] != b.shape[0]:
        raise ValueError(f"tessera::bmm takes 3-D tensors of one batch, got {tuple(a.shape)} and {tuple(b.shape)}")
    m, n, k = _gemm_sizes(a, b, trans_a, trans_b, "bmm")
    out = run(ops.batched_gemm(a.shape[0], m, n, k, trans_a=trans_a, trans_b=trans_b), {"A": a, "B": b})
    return out.view(a.shape[0], m, n)


@bmm.register_fake
def _(a, b, trans_a=False, trans_b=False):
    m, n, _ = _gemm_sizes(a, b, trans_a, trans_b, "bmm")
    return a.new_empty((a.shape[0], m, n))


def _gemm_setup(ctx, inputs, output):
    a, b, trans_a, trans_b = inputs
    ctx.save_for_backward(a, b)
    ctx.trans = (trans_a, trans_b)


def _gemm_backward(fn):
    """C = op(A) op(B): d op(A) = dC op(B)^T and d op(B) = op(A)^T dC, stored as A and B are."""

    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        ta, tb = ctx.trans
        grad = grad.contiguous()
        da = db = None
        if ctx.needs_input_grad[0]:
            da = fn(b, grad, tb, True) if ta else fn(grad, b, False, not tb)
        if ctx.needs_input_grad[1]:
            db = fn(grad, a, True, ta) if tb else fn(a, grad, not ta, False)
        return da, db, None, None

    return backward


matmul.register_autograd(_gemm_backward(matmul), setup_context=_gemm_setup)
bmm.register_autograd(_gemm_backward(bmm), setup_context=_gemm_setup)


# ---- conv2d ------------------------------------------------------------------------------
def conv_shape(input_shape, weight_shape, stride, padding, groups) -> ops.Conv2dShape:
    n, c, h, w = input_shape
    cout, cig, kh, kw = weight_shape
    if c % groups or cig != c // groups:
        raise ValueError(f"tessera::conv2d: weight {tuple(weight_shape)} does not fit {c} input channels "
                         f"in {groups} group(s) (expected {c // groups if c % groups == 0 else '?'} per group)")
    return ops.Conv2dShape(batch=n, in_channels=c, out_channels=cout, height=h, width=w, kernel=(kh, kw),
                           stride=tuple(stride), padding=tuple(padding), groups=groups)


def _dims(x: Tensor, w: Tensor) -> None:
    if x.dim() != 4 or w.dim() != 4:
        raise ValueError(f"tessera::conv2d takes a 4-D input and weight, got {tuple(x.shape)} and {tuple(w.shape)}")


@torch.library.custom_op("tessera::conv2d", mutates_args=())
def conv2d(x: Tensor, weight: Tensor, stride: Sequence[int], padding: Sequence[int], groups: int) -> Tensor:
    _check("conv2d", input=x, weight=weight)
    _dims(x, weight)
    s = conv_shape(x.shape, weight.shape, stride, padding, groups)
    return run(ops.conv2d(s), {"X": x, "W": weight}).view(s.output_shape)


@conv2d.register_fake
def _(x, weight, stride, padding, groups):
    _dims(x, weight)
    return x.new_empty(conv_shape(x.shape, weight.shape, stride, padding, groups).output_shape)


def data_grad_ops(s: ops.Conv2dShape, threads: int) -> list[Operator]:
    """The data gradient as GEMM + col2im or as one direct scatter: the model's faster pair."""
    machine = load_machine()

    def cost(op):
        return predict(op, best_schedule(op, threads=threads, machine=machine), machine, threads)

    two = [ops.conv2d_column_grad(s), ops.col2im(s)]
    one = [ops.conv2d_data_grad_direct(s)]
    if s.depthwise or (s.in_channels // s.groups) * s.kernel[0] * s.kernel[1] == 1:
        return one
    return two if sum(map(cost, two)) <= cost(one[0]) else one


@torch.library.custom_op("tessera::conv2d_input_grad", mutates_args=())
def conv2d_input_grad(grad: Tensor, weight: Tensor, input_shape: Sequence[int], stride: Sequence[int],
                      padding: Sequence[int], groups: int) -> Tensor:
    _check("conv2d_input_grad", grad=grad, weight=weight)
    s = conv_shape(input_shape, weight.shape, stride, padding, groups)
    steps = data_grad_ops(s, torch.get_num_threads())
    if len(steps) == 1:
        return run(steps[0], {"W": weight, "dY": grad}).view(s.input_shape)
    cols = run(steps[0], {"W": weight, "dY": grad})
    return run(steps[1], {"dCol": cols}).view(s.input_shape)


@conv2d_input_grad.register_fake
def _(grad, weight, input_shape, stride, padding, groups):
    return grad.new_empty(tuple(input_shape))


@torch.library.custom_op("tessera::conv2d_weight_grad", mutates_args=())
def conv2d_weight_grad(grad: Tensor, x: Tensor, weight_shape: Sequence[int], stride: Sequence[int],
                       padding: Sequence[int], groups: int) -> Tensor:
    _check("conv2d_weight_grad", grad=grad, input=x)
    s = conv_shape(x.shape, weight_shape, stride, padding, groups)
    return run(ops.conv2d_weight_grad(s), {"dY": grad, "X": x}).view(s.weight_shape)


@conv2d_weight_grad.register_fake
def _(grad, x, weight_shape, stride, padding, groups):
    return x.new_empty(tuple(weight_shape))


def _conv_setup(ctx, inputs, output):
    x, weight, stride, padding, groups = inputs
    ctx.save_for_backward(x, weight)
    ctx.conv = (list(stride), list(padding), groups)


def _conv_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    stride, padding, groups = ctx.conv
    grad = grad.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = conv2d_input_grad(grad, weight, list(x.shape), stride, padding, groups)
    if ctx.needs_input_grad[1]:
        dw = conv2d_weight_grad(grad, x, list(weight.shape), stride, padding, groups)
    return dx, dw, None, None, None


conv2d.register_autograd(_conv_backward, setup_context=_conv_setup)
