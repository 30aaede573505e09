"""The custom ops from PyTorch: forward and backward equal torch's (float32, compared at
the float32 error bound's scale), fake kernels give shapes without data, the registrations
pass torch.library.opcheck, the modules drop into place, and wrong input is refused."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from tessera.kernels import Conv2d, Linear, compile_kernel, convert, ops
from tessera.kernels import torch_ops as T
from tessera.kernels.machine import cpu_isas
from tessera.kernels.schedule import DirectSchedule, GemmSchedule

# float32 sums of K products agree with float64 to about sqrt(K) * 6e-8 relative (random
# signs); 1e-4 relative to the largest entry leaves a 100-fold margin at these sizes.
RTOL = 1e-4


def close(got, want):
    scale = want.abs().max().clamp_min(1e-6)
    assert (got.double() - want.double()).abs().max() <= RTOL * scale


@pytest.fixture(autouse=True)
def _machine(machine):
    return machine


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_forward_backward(ta, tb):
    torch.manual_seed(0)
    a = torch.randn((13, 7) if ta else (7, 13), dtype=torch.float64, requires_grad=True)
    b = torch.randn((5, 13) if tb else (13, 5), dtype=torch.float64, requires_grad=True)
    a32, b32 = (t.detach().float().requires_grad_() for t in (a, b))
    out = T.matmul(a32, b32, ta, tb)
    ref = (a.T if ta else a) @ (b.T if tb else b)
    close(out, ref)
    g = torch.randn_like(ref)
    out.backward(g.float())
    ref.backward(g)
    close(a32.grad, a.grad)
    close(b32.grad, b.grad)


def test_bmm_and_fake_shapes():
    a, b = torch.randn(3, 4, 6, requires_grad=True), torch.randn(3, 5, 6, requires_grad=True)
    out = T.bmm(a, b, False, True)
    close(out, a.double() @ b.double().transpose(1, 2))
    out.sum().backward()
    close(b.grad, (a.double().transpose(1, 2) @ torch.ones(3, 4, 5, dtype=torch.float64)).transpose(1, 2))
    with FakeTensorMode():
        x, w = torch.empty(2, 4, 9, 9), torch.empty(8, 2, 3, 3)
        assert T.conv2d(x, w, [2, 2], [1, 1], 2).shape == (2, 8, 5, 5)
        assert T.matmul(torch.empty(3, 4), torch.empty(5, 4), False, True).shape == (3, 5)


def test_opcheck_registrations():
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(T.matmul, (torch.randn(4, 3, requires_grad=True), torch.randn(3, 5), False, False), test_utils=checks)
    args = (torch.randn(1, 2, 5, 5, requires_grad=True), torch.randn(3, 2, 3, 3, requires_grad=True), [1, 1], [1, 1], 1)
    torch.library.opcheck(T.conv2d, args, test_utils=checks)


@pytest.mark.parametrize("groups,stride,padding", [(1, 1, 1), (2, 2, 1), (4, 1, 0)])
def test_conv2d_module_equals_torch(groups, stride, padding):
    torch.manual_seed(groups)
    ref = torch.nn.Conv2d(4, 8 if groups < 4 else 4, 3, stride=stride, padding=padding, groups=groups)
    mine = Conv2d(4, ref.out_channels, 3, stride=stride, padding=padding, groups=groups)
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4, 7, 6, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y_ref = mine(x), ref(x2)
    close(y, y_ref)
    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    close(x.grad, x2.grad)
    close(mine.weight.grad, ref.weight.grad)
    close(mine.bias.grad, ref.bias.grad)


def test_linear_module_and_convert():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(2 * 4 * 4, 3))
    x = torch.randn(2, 1, 6, 6)
    want = model(x)
    convert(model)
    assert isinstance(model[0], Conv2d) and isinstance(model[2], Linear)
    close(model(x), want)
    lin = Linear(6, 2)
    close(lin(torch.ones(2, 3, 6)), F.linear(torch.ones(2, 3, 6), lin.weight, lin.bias))


def _per_call(mine, x):
    """The module's output through the custom op (the weight packed in each call)."""
    if isinstance(mine, Conv2d):
        return T.conv2d(x, mine.weight, [1, 1], [1, 1], 1) + mine.bias.view(1, -1, 1, 1)
    return T.matmul(x, mine.weight, False, True) + mine.bias


def test_inference_keeps_the_weight_packed_and_repacks_when_it_changes():
    torch.manual_seed(3)
    isa = "avx512" if "avx512" in cpu_isas() else "avx2"
    conv, lin = Conv2d(16, 32, 3, padding=1), Linear(48, 96)
    cx, lx = torch.randn(2, 16, 7, 7), torch.randn(5, 48)
    # each module's kernel pinned to a schedule that takes a packed weight (the pick for a shape is
    # kept per process, so an earlier test's could otherwise be one that packs per call): flatc for
    # the conv, a GEMM that packs B for the Linear
    threads = torch.get_num_threads()
    pins = ((ops.conv2d(T.conv_shape(cx.shape, conv.weight.shape, (1, 1), (1, 1), 1)),
             DirectSchedule(algo="flatc", isa=isa, rows=7, vecs=2 if isa == "avx512" else 1)),
            (ops.gemm(5, 96, 48, trans_b=True),
             GemmSchedule(isa=isa, mr=4, nr=16 if isa == "avx512" else 8, mc=8, nc=32, kc=16, parallel="ic")))
    for op, schedule in pins:
        T._KERNELS[(op.signature(), threads)] = compile_kernel(op, schedule)
    for mine, x in ((conv, cx), (lin, lx)):
        with torch.no_grad():
            got = mine(x)
            assert torch.equal(got, _per_call(mine, x))  # the same sums in the same order as packing per call
            assert len(mine.__dict__.get("_tessera_packed", {})) == 1  # the weight was packed, once
            assert torch.equal(mine(x), got)  # the kept packing: a second call agrees
            mine.weight.mul_(-2.0)  # in place: the version moves, so the weight is packed again
            again = mine(x)
        assert not torch.equal(again, got)
        with torch.no_grad():
            assert torch.equal(again, _per_call(mine, x))
        # with gradients wanted the custom op (and its autograd) runs, not the packed path
        y = mine(x.requires_grad_())
        assert y.grad_fn is not None


def test_inference_keeps_packed_weights_for_the_last_few_input_shapes_only():
    # a server's Linear meets many batch sizes; each may pick its own schedule (packing), so the layer
    # keeps the packings of the last PACKED_SHAPES shapes, not one per shape ever met
    isa = "avx512" if "avx512" in cpu_isas() else "avx2"
    lin, threads = Linear(48, 96), torch.get_num_threads()
    sizes = range(2, T.PACKED_SHAPES + 4)  # 1 row would be a GEMV, which packs nothing
    for m in sizes:  # pinned to a schedule that packs B, as in the test above
        op = ops.gemm(m, 96, 48, trans_b=True)
        T._KERNELS[(op.signature(), threads)] = compile_kernel(
            op, GemmSchedule(isa=isa, mr=4, nr=16 if isa == "avx512" else 8, mc=8, nc=32, kc=16, parallel="ic"))
    with torch.no_grad():
        for m in (*sizes, 2):
            x = torch.randn(m, 48)
            assert torch.equal(lin(x), _per_call(lin, x))
            assert len(lin.__dict__["_tessera_packed"]) <= T.PACKED_SHAPES
    kept = [key[0] for key in lin.__dict__["_tessera_packed"]]
    assert len(kept) == T.PACKED_SHAPES and kept[-1] == ops.gemm(2, 96, 48, trans_b=True).signature()


def test_wrong_input_is_refused():
    with pytest.raises(ValueError, match="dtype torch.float64; Tessera's kernels take float32"):
        T.matmul(torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"shapes \(2, 3\) and \(2, 3\) do not multiply"):
        T.matmul(torch.ones(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="does not fit 4 input channels"):
        T.conv2d(torch.ones(1, 4, 5, 5), torch.ones(2, 3, 3, 3), [1, 1], [0, 0], 1)
    with pytest.raises(ValueError, match="dilation 1"):
        Conv2d(2, 2, 3, dilation=2)
