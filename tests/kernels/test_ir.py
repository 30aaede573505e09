"""The IR's operators mean what torch means: the float64 interpreter of each builder equals
torch's float64 op (conv with stride, padding, groups, depthwise; GEMM transposes; the
conv's backward operators against autograd), and the IR refuses malformed operators."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tessera.kernels import ops, reference
from tessera.kernels.contraction import NotTensorizable, analyse
from tessera.kernels.ir import Affine, Axis, Operator, Tensor

CONVS = [
    ops.Conv2dShape(batch=2, in_channels=3, out_channels=5, height=7, width=7, kernel=(3, 3), stride=(2, 2), padding=(1, 1)),
    ops.Conv2dShape(batch=1, in_channels=6, out_channels=4, height=10, width=7, kernel=(3, 2), stride=(2, 1), padding=(1, 0)),
    ops.Conv2dShape(batch=1, in_channels=4, out_channels=6, height=5, width=6, kernel=(3, 3), padding=(1, 1), groups=2),
    ops.Conv2dShape(batch=2, in_channels=4, out_channels=4, height=6, width=5, kernel=(3, 3), stride=(2, 2), padding=(1, 1), groups=4),
]


def _torch_conv_grads(s, x, w, dy):
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    y = F.conv2d(xt, wt, stride=s.stride, padding=s.padding, groups=s.groups)
    y.backward(torch.tensor(dy, dtype=torch.float64))
    return y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()


@pytest.mark.parametrize("s", CONVS, ids=lambda s: s.label())
def test_conv_operators_equal_torch(s):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(s.input_shape), rng.standard_normal(s.weight_shape)
    dy = rng.standard_normal(s.output_shape)
    y_ref, dx_ref, dw_ref = _torch_conv_grads(s, x, w, dy)
    y = reference.evaluate(ops.conv2d(s), {"X": x, "W": w}).reshape(s.output_shape)
    dw = reference.evaluate(ops.conv2d_weight_grad(s), {"dY": dy, "X": x}).reshape(s.weight_shape)
    cols = reference.evaluate(ops.conv2d_column_grad(s), {"W": w, "dY": dy})
    dx = reference.evaluate(ops.col2im(s), {"dCol": cols}).reshape(s.input_shape)
    dx_direct = reference.evaluate(ops.conv2d_data_grad_direct(s), {"W": w, "dY": dy}).reshape(s.input_shape)
    for got, want in ((y, y_ref), (dw, dw_ref), (dx, dx_ref), (dx_direct, dx_ref)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)  # both float64, same terms


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_operators_equal_matmul(ta, tb):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    got = reference.evaluate(ops.gemm(5, 3, 7, trans_a=ta, trans_b=tb), {"A": a.T if ta else a, "B": b.T if tb else b})
    # float64 sums of 7 products, perhaps in another order: ~1e-15 relative; 1e-12 is float64-tight
    np.testing.assert_allclose(got, a @ b, rtol=1e-12)
    batched = rng.standard_normal((4, 5, 7))
    got = reference.evaluate(ops.batched_gemm(4, 5, 3, 7), {"A": batched, "B": np.stack([b] * 4)})
    np.testing.assert_allclose(got, batched @ b, rtol=1e-12)  # as above


def test_affine_algebra_and_guards():
    m, k = Axis("m", 4), Axis("k", 3)
    e = 2 * m + k - 1
    assert e == Affine((("k", 1), ("m", 2)), -1) and e.range({"m": 4, "k": 3}) == (-1, 7)
    x = Tensor("X", (8,))
    assert x[e].guarded_dims({"m": 4, "k": 3}) == (0,)
    assert x[m + k].guarded_dims({"m": 4, "k": 3}) == ()
    assert ops.gemm(3, 4, 5).signature() == ops.gemm(3, 4, 5).signature() != ops.gemm(3, 4, 6).signature()


def test_contraction_groups_of_a_conv():
    s = CONVS[0]
    con = analyse(ops.conv2d(s))
    assert [a.name for a in con.m] == ["co"] and [a.name for a in con.k] == ["ci", "r", "s"]
    assert [a.name for a in con.n] == ["n", "oh", "ow"] and con.batch == ()
    assert [a.name for a in analyse(ops.conv2d(s), fuse_n=False).batch] == ["n"]
    with pytest.raises(NotTensorizable, match="M is empty"):
        analyse(ops.conv2d(CONVS[3]))  # depthwise: one output channel per group


def test_malformed_operators_are_refused():
    m = Axis("m", 4)
    with pytest.raises(ValueError, match="extent 0"):
        Axis("k", 0)
    with pytest.raises(ValueError, match="dtype 'float16'"):
        Tensor("A", (4,), dtype="float16")
    with pytest.raises(ValueError, match="indexed with 2"):
        Tensor("A", (4,))[m, m]
    with pytest.raises(ValueError, match="undeclared axes"):
        Operator(name="bad", axes=(m,), output=Tensor("C", (4,))[m], body=Tensor("A", (4,))[Axis("j", 4)])
    with pytest.raises(ValueError, match="not divisible by groups"):
        ops.Conv2dShape(batch=1, in_channels=3, out_channels=4, height=5, width=5, kernel=(3, 3), groups=2)
    with pytest.raises(ValueError, match="does not fit"):
        ops.Conv2dShape(batch=1, in_channels=1, out_channels=1, height=2, width=2, kernel=(3, 3))
