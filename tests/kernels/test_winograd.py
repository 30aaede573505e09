"""Winograd F(2x2, 3x3) and F(4x4, 3x3) against float64, within the rounding bound of the
algorithm itself (the direct sum's bound does not apply: the transforms add and scale). The
bound is the standard one for a bilinear algorithm: every output's error is at most gamma(L)
times the same computation carried out on absolute values,

    |y - y_exact| <= gamma(L) * |A^T| [ sum_c (|G| |g| |G^T|) * (|B^T| |d| |B|) ] |A|

with L the longest chain of roundings an output goes through (weight transform 6 and its
constants 2, input transform 8, the product 1, the GEMM's sum over C at most 2C, output
transform 12)."""

import numpy as np
import pytest
from kernel_checks import UNIT_ROUNDOFF, assert_prepacked_weight_agrees, random_inputs, run

from tessera.kernels import compile_kernel, ops, reference
from tessera.kernels.machine import cpu_isas
from tessera.kernels.schedule import GemmSchedule, WinogradSchedule
from tessera.kernels.tuner import rank
from tessera.kernels.winograd import applies

BT = {2: [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
      4: [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
          [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]]}
G = {2: [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
     4: [[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6], [1 / 24, 1 / 12, 1 / 6],
         [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]]}
AT = {2: [[1, 1, 1, 0], [0, 1, -1, -1]],
      4: [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]}


def winograd_bound(s: ops.Conv2dShape, w: np.ndarray, x: np.ndarray, m: int) -> np.ndarray:
    bt, g, at = (np.abs(np.array(t[m], dtype=np.float64)) for t in (BT, G, AT))
    a = m + 2
    w, x = w.reshape(s.weight_shape), x.reshape(s.input_shape)
    th, tw = -(-s.out_height // m), -(-s.out_width // m)
    (ph, pw) = s.padding
    xp = np.zeros((s.batch, s.in_channels, th * m + 2, tw * m + 2))
    h, wd = min(s.height, th * m + 2 - ph), min(s.width, tw * m + 2 - pw)
    xp[:, :, ph:ph + h, pw:pw + wd] = np.abs(x[:, :, :h, :wd])
    d = np.lib.stride_tricks.sliding_window_view(xp, (a, a), axis=(2, 3))[:, :, ::m, ::m][:, :, :th, :tw]
    u = np.einsum("ar,kcrs,bs->kcab", g, np.abs(w.astype(np.float64)), g)
    v = np.einsum("ai,nctuij,bj->nctuab", bt, d, bt)
    y = np.einsum("ia,nktuab,jb->nktiuj", at, np.einsum("kcab,nctuab->nktuab", u, v), at)
    y = y.reshape(s.batch, s.out_channels, th * m, tw * m)[:, :, : s.out_height, : s.out_width]
    chain = 2 * s.in_channels + 6 * a + 16
    return chain * UNIT_ROUNDOFF / (1 - chain * UNIT_ROUNDOFF) * y


SHAPES = [
    ops.Conv2dShape(batch=1, in_channels=5, out_channels=7, height=9, width=11, kernel=(3, 3), padding=(1, 1)),
    ops.Conv2dShape(batch=2, in_channels=3, out_channels=4, height=6, width=13, kernel=(3, 3)),
    ops.Conv2dShape(batch=1, in_channels=16, out_channels=20, height=17, width=70, kernel=(3, 3), padding=(1, 1)),
    ops.Conv2dShape(batch=1, in_channels=4, out_channels=3, height=7, width=7, kernel=(3, 3), padding=(2, 2)),
    # a row of 40 columns, no padding: the vector split of F(2)'s plane (32 at a time) from an even column
    ops.Conv2dShape(batch=1, in_channels=3, out_channels=5, height=5, width=40, kernel=(3, 3)),
]
ISAS = tuple(cpu_isas())


@pytest.mark.parametrize("s", SHAPES, ids=lambda s: s.label())
@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("isa", ISAS)
def test_winograd_within_its_bound_and_thread_invariant(s, m, isa):
    op = ops.conv2d(s)
    inputs = random_inputs(op, seed=7)
    gemm = GemmSchedule(isa=isa, mr=4, nr=16 if isa == "avx512" else 8, mc=8, nc=32, kc=8, parallel="batch")
    kernel = compile_kernel(op, WinogradSchedule(m=m, isa=isa, gemm=gemm))
    one, two = run(kernel, op, inputs, 1), run(kernel, op, inputs, 2)
    np.testing.assert_array_equal(one, two)  # planes and GEMM batches split over threads, sums unchanged
    assert_prepacked_weight_agrees(kernel, op, inputs, one)  # the weight transformed once at bind
    exact = reference.evaluate(op, inputs).reshape(s.output_shape)
    err = np.abs(one.reshape(s.output_shape).astype(np.float64) - exact)
    bound = winograd_bound(s, inputs["W"], inputs["X"], m)
    assert np.all(err <= bound), f"F({m},3): error exceeds its bound by {np.max(err - bound):.3g}"
    # the bound is not vacuous: within 10^4 of the errors seen (F(4,3)'s is the looser)
    assert np.max(bound) < 1e4 * max(np.max(err), 1e-30)


def test_winograd_is_offered_only_for_3x3_stride_1_single_group(machine):
    plain = ops.conv2d(SHAPES[0])
    strided = ops.conv2d(ops.Conv2dShape(batch=1, in_channels=4, out_channels=4, height=9, width=9, kernel=(3, 3),
                                         stride=(2, 2), padding=(1, 1)))
    grouped = ops.conv2d(ops.Conv2dShape(batch=1, in_channels=4, out_channels=4, height=9, width=9, kernel=(3, 3),
                                         groups=2))
    one_by_one = ops.conv2d(ops.Conv2dShape(batch=1, in_channels=4, out_channels=4, height=9, width=9, kernel=(1, 1)))
    assert applies(plain, 2) and applies(plain, 4)
    for op in (strided, grouped, one_by_one):
        assert not applies(op, 2)
        assert all(t.schedule.kind != "winograd" for t in rank(op, threads=1, machine=machine))
    kinds = {t.schedule.kind for t in rank(plain, threads=1, machine=machine)}
    assert "winograd" in kinds


def test_winograd_forced_where_it_does_not_apply():
    strided = ops.conv2d(ops.Conv2dShape(batch=1, in_channels=4, out_channels=4, height=9, width=9, kernel=(3, 3),
                                         stride=(2, 2), padding=(1, 1)))
    with pytest.raises(ValueError) as exc:
        compile_kernel(strided, WinogradSchedule(m=2))
    assert "Winograd takes a 3x3 convolution of stride 1 and one group" in str(exc.value)
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="Winograd output tile m=3"):
        WinogradSchedule(m=3)
