"""Generated convolution kernels against the float64 reference within the error bound:
implicit GEMM (the micro-kernel over an im2col packed on the fly) and the direct loop nest,
with strides, padding, asymmetric kernels, groups and depthwise; and the operators of the
backward pass (weight gradient, column gradient + col2im, direct data gradient)."""

import numpy as np
import pytest
from kernel_checks import assert_within_bound, random_inputs, run

from tessera.kernels import compile_kernel, ops, reference
from tessera.kernels.codegen_loops import default_loop_schedule
from tessera.kernels.machine import cpu_isas
from tessera.kernels.schedule import GemmSchedule, LoopSchedule

SHAPES = [
    ops.Conv2dShape(batch=2, in_channels=3, out_channels=5, height=7, width=7, kernel=(3, 3), stride=(2, 2), padding=(1, 1)),
    ops.Conv2dShape(batch=1, in_channels=4, out_channels=7, height=9, width=11, kernel=(3, 3), padding=(1, 1)),
    ops.Conv2dShape(batch=2, in_channels=8, out_channels=8, height=6, width=6, kernel=(1, 1)),
    ops.Conv2dShape(batch=1, in_channels=6, out_channels=4, height=10, width=7, kernel=(3, 2), stride=(2, 1), padding=(1, 0)),
    ops.Conv2dShape(batch=1, in_channels=4, out_channels=6, height=5, width=6, kernel=(3, 3), padding=(1, 1), groups=2),
]
DEPTHWISE = [
    ops.Conv2dShape(batch=2, in_channels=8, out_channels=8, height=7, width=7, kernel=(3, 3), padding=(1, 1), groups=8),
    ops.Conv2dShape(batch=1, in_channels=4, out_channels=4, height=9, width=8, kernel=(3, 3), stride=(2, 2), padding=(1, 1), groups=4),
]
GEMM = GemmSchedule(mc=12, nc=32, kc=8, parallel="jr")  # small blocks: every tail runs


def _check(op, schedule, threads=2, seed=0):
    inputs = random_inputs(op, seed)
    out = run(compile_kernel(op, schedule), op, inputs, threads)
    assert_within_bound(out, op, inputs)
    return out


# rows of 38 and 20 stride-2 outputs: B's packing copies runs of up to 32 columns, taking every
# second input element (the vector path from 17 on), cut by the zero padding at both ends
WIDE_STRIDED = [
    ops.Conv2dShape(batch=1, in_channels=2, out_channels=3, height=5, width=75, kernel=(3, 3), stride=(2, 2),
                    padding=(1, 1)),
    ops.Conv2dShape(batch=1, in_channels=2, out_channels=4, height=9, width=40, kernel=(7, 7), stride=(2, 2),
                    padding=(3, 3)),
]


@pytest.mark.parametrize("s", SHAPES + WIDE_STRIDED, ids=lambda s: s.label())
def test_conv_implicit_gemm_and_direct(s):
    op = ops.conv2d(s)
    implicit = _check(op, GEMM)
    direct = _check(op, default_loop_schedule(op, threads=2))
    np.testing.assert_allclose(implicit, direct, rtol=1e-4, atol=1e-5)  # both within the bound of the same sum


@pytest.mark.parametrize("s", WIDE_STRIDED, ids=lambda s: s.label())
def test_stride_two_runs_packed_with_vectors(s):
    # two vectors a panel on the widest ISA here (NR = 32 on AVX-512, 16 on AVX2, where a 4 x 32
    # tile would need 21 of its 16 registers): runs longer than a vector of stride-2 columns
    # take the vector gather
    op = ops.conv2d(s)
    isa = "avx512" if "avx512" in cpu_isas() else "avx2"
    nr = 32 if isa == "avx512" else 16
    wide = _check(op, GemmSchedule(isa=isa, mr=4, nr=nr, mc=8, nc=2 * nr, kc=16, parallel="jr"))
    plain = _check(op, default_loop_schedule(op, threads=2))
    np.testing.assert_allclose(wide, plain, rtol=1e-4, atol=1e-5)  # both within the bound of the same sum


# output rows of 7, 20 and 13 columns: a 32-column panel spans several rows, so B's packing
# copies short runs, each cut by the zero padding at the row's ends (on AVX-512 a run's last
# part, or a whole run under 16 or 17 columns, is one masked move; strides 1 and 2)
SHORT_RUNS = [
    ops.Conv2dShape(batch=1, in_channels=3, out_channels=5, height=7, width=7, kernel=(3, 3), padding=(1, 1)),
    ops.Conv2dShape(batch=2, in_channels=2, out_channels=3, height=4, width=20, kernel=(3, 3), padding=(1, 1)),
    ops.Conv2dShape(batch=1, in_channels=3, out_channels=4, height=9, width=26, kernel=(3, 3), stride=(2, 2),
                    padding=(1, 1)),
    ops.Conv2dShape(batch=1, in_channels=2, out_channels=3, height=8, width=14, kernel=(5, 5), stride=(2, 2),
                    padding=(2, 2)),
]


@pytest.mark.parametrize("s", SHORT_RUNS, ids=lambda s: s.label())
def test_short_runs_packed_with_masks(s):
    op = ops.conv2d(s)
    isa = "avx512" if "avx512" in cpu_isas() else "avx2"
    nr = 32 if isa == "avx512" else 24  # the widest 4-row tile each ISA's registers hold; both span rows
    for kc in (5, 64):  # a k block that cuts the taps, and all of K
        _check(op, GemmSchedule(isa=isa, mr=4, nr=nr, mc=8, nc=2 * nr, kc=kc, parallel="jr"))


def test_stride_two_rows_wider_than_a_panel():
    """Output rows of 71 columns: most 32- and 48-column panels lie inside one row, in bounds,
    their columns two floats apart in the input, and are packed as the evens of two vectors
    at a time (the 7x7 stem's case); the panels that cross a row or the padding take the runs."""
    s = ops.Conv2dShape(batch=1, in_channels=2, out_channels=5, height=6, width=141, kernel=(7, 7), stride=(2, 2),
                        padding=(3, 3))
    op = ops.conv2d(s)
    isa = "avx512" if "avx512" in cpu_isas() else "avx2"
    for nr in ((32, 48) if isa == "avx512" else (16, 24)):
        _check(op, GemmSchedule(isa=isa, mr=4, nr=nr, mc=8, nc=2 * nr, kc=40, parallel="jr"))


def test_conv_batch_loop_and_other_orders():
    op = ops.conv2d(SHAPES[0])
    _check(op, GemmSchedule(mc=6, nc=16, kc=5, fuse_n=False, parallel="batch", order="ic,pc,jc"))
    _check(op, GemmSchedule(mr=4, nr=24, mc=8, nc=48, kc=11, inner="ir,jr", parallel="ic"))


@pytest.mark.parametrize("s", SHAPES[:2] + SHAPES[4:], ids=lambda s: s.label())
def test_conv_backward_operators(s):
    _check(ops.conv2d_weight_grad(s), GEMM)
    _check(ops.conv2d_column_grad(s), GEMM)
    col2im = ops.col2im(s)
    _check(col2im, default_loop_schedule(col2im, threads=2))
    direct = ops.conv2d_data_grad_direct(s)
    _check(direct, default_loop_schedule(direct, threads=2))


@pytest.mark.parametrize("s", DEPTHWISE, ids=lambda s: s.label())
def test_depthwise_loop_nests(s):
    for op in (ops.conv2d(s), ops.conv2d_weight_grad(s), ops.conv2d_data_grad_direct(s)):
        _check(op, default_loop_schedule(op, threads=2))
    wgrad = ops.conv2d_weight_grad(s)  # the reduction innermost: a vectorised sum in a register
    _check(wgrad, LoopSchedule(order=("g", "r", "s", "n", "oh", "ow"), parallel=1))


def test_stencil_with_a_sum_body():
    """A body that is not a product (issue 14's stencils): reads keep their own guards."""
    from tessera.kernels.ir import Axis, Operator, Tensor

    i, j = Axis("i", 13), Axis("j", 17)
    x, y = Tensor("x", (13, 17)), Tensor("y", (13, 17))
    body = 0.5 * x[i, j] + 0.125 * x[i - 1, j] + 0.125 * x[i + 1, j] + 0.125 * x[i, j - 1] + 0.125 * x[i, j + 1]
    op = Operator(name="jacobi", axes=(i, j), output=y[i, j], body=body)
    inputs = random_inputs(op)
    out = run(compile_kernel(op, LoopSchedule(order=("i", "j"), parallel=1)), op, inputs, 2)
    np.testing.assert_allclose(out, reference.evaluate(op, inputs), rtol=1e-6, atol=1e-6)  # 5 terms, |c| <= 1/2
