"""The operator compiler's AMX GEMM (``direct.py``'s ``amx`` kernel on ``csrc/tessera_gemm_amx.h``,
GEMMs and 1x1 convolutions): float32 accuracy from six bfloat16 tile products a product, against a float64 reference on odd
shapes (tails of every tile and k block), B stored either way, packed per call or once, and the
same bits at any thread count. The numeric tests skip where the CPU has no AMX-BF16; the space
and refusal tests run everywhere."""

import json

import numpy as np
import pytest

from tessera.kernels import direct, ops
from tessera.kernels.amx import amx_ready
from tessera.kernels.kernel import compile_kernel
from tessera.kernels.machine import Machine
from tessera.kernels.model import predict
from tessera.kernels.schedule import DirectSchedule, schedule_from_dict
from tessera.kernels.tuner import random_inputs

needs_amx = pytest.mark.skipif(amx_ready() is not None, reason=f"AMX: {amx_ready()}")


def _errors(op, a, b, c, trans_b):
    """max |C - C64| over max |C64|, and the same for numpy's float32 matmul (a float32 GEMM)."""
    bm = b.T if trans_b else b
    exact = a.astype(np.float64) @ bm.astype(np.float64)
    scale = np.abs(exact).max()
    return np.abs(c - exact).max() / scale, np.abs(a @ bm - exact).max() / scale


# M, N, K: M below one 16-row tile and between tiles, N not a multiple of 16 or 32, K not of 32
# and over two k blocks (kc 96 on K = 300: 4 blocks with a tail)
# (and N = 1024: B [K, N] rows 4 KiB apart, packed whole though A's rows fit one block)
SHAPES = [(5, 3, 64), (16, 37, 129), (97, 1000, 300), (300, 40, 1600), (33, 200, 300), (20, 1024, 70)]


@needs_amx
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_amx_gemm_equals_the_float64_product(m, n, k, trans_b):
    op = ops.gemm(m, n, k, trans_b=trans_b)
    a, b = random_inputs(op, seed=m + n + k)
    kernel = compile_kernel(op, DirectSchedule(algo="amx", isa="avx512", rows=64, vecs=96))
    c = kernel(a, b)
    err, fp32 = _errors(op, a, b, c, trans_b)
    # bf16x6 leaves out products below 2^-23 of each term and sums in float32 as a float32 GEMM
    # does: its error is a float32 GEMM's (measured 0.2-0.5x numpy's float32 matmul here); 2x
    # numpy's is the float32 tolerance, and bf16x3 (8-11x, tests/kernels/test_serving_kernels.py)
    # or one bfloat16 rounding (~1e-3) fails it
    assert err <= 2 * fp32 + 1e-7, (err, fp32)
    # packed once (a weight) computes the same bits as per call (M 5, 16, 33 within the 64-row
    # block: each column pair of B split where it is used; 97, 300: B packed whole first); 2 threads as 1
    packed = kernel.prepack(1, b)
    assert np.array_equal(kernel.run_prepacked(packed, a, b), c)
    assert np.array_equal(kernel(a, b, threads=2), c)


def test_b_is_split_where_used_except_a_kn_b_whose_rows_are_4_kib_apart():
    def fused(op, rows=128):
        return direct.amx_splits_where_used(direct.amx_of(op), rows)

    assert fused(ops.gemm(128, 2304, 768)) and fused(ops.gemm(128, 3072, 768, trans_b=True))
    assert not fused(ops.gemm(128, 3072, 768)) and not fused(ops.gemm(16, 1024, 64))
    assert not fused(ops.gemm(300, 2304, 768))  # more rows than a block: packed whole, as before
    # a batch and a gathered convolution split B where used whatever their width (64x64 = 4096)
    assert fused(_conv(ci=32, co=32, h=64, w=64)) and fused(_conv(ci=32, co=32, h=64, w=64, kernel=(3, 3)))


@needs_amx
def test_amx_blocks_change_only_the_speed_not_the_k_order_within_a_block():
    # kc and mb are cache blocks: every kc computes the product to float32 accuracy (the k
    # blocks' partial sums go through C), and mb does not change a single bit (rows are independent;
    # mb 128 holds all 97 rows, so B is split per column pair there and packed whole at mb 32)
    op = ops.gemm(97, 70, 300)
    a, b = random_inputs(op, seed=3)
    outs = {(mb, kc): compile_kernel(op, DirectSchedule(algo="amx", isa="avx512", rows=mb, vecs=kc))(a, b)
            for mb in (32, 128) for kc in (32, 96, 320)}
    for (_, kc), c in outs.items():
        assert _errors(op, a, b, c, False)[0] <= 2 * _errors(op, a, b, a @ b, False)[1] + 1e-7
        assert np.array_equal(c, outs[(32, kc)])


def _conv(n=2, ci=48, co=40, h=7, w=9, kernel=(1, 1), **kw):
    return ops.conv2d(ops.Conv2dShape(batch=n, in_channels=ci, out_channels=co, height=h, width=w, kernel=kernel, **kw))


@needs_amx
def test_amx_1x1_convolution_equals_the_float64_product():
    # a 1x1 convolution of stride 1 is one GEMM an image sharing A (the weight [C_out, C_in]),
    # B the image [C_in, H W]: 63 positions (not a multiple of 16), 40 output channels
    op = _conv()
    w, x = random_inputs(op, seed=5)
    kernel = compile_kernel(op, DirectSchedule(algo="amx", isa="avx512", rows=32, vecs=32))
    y = kernel(w, x)
    a, b = w.reshape(40, 48), x.reshape(2, 48, 63)
    exact = np.einsum("oc,ncp->nop", a.astype(np.float64), b.astype(np.float64)).reshape(y.shape)
    fp32 = np.einsum("oc,ncp->nop", a, b).reshape(y.shape)
    scale = np.abs(exact).max()
    assert np.abs(y - exact).max() / scale <= 2 * np.abs(fp32 - exact).max() / scale + 1e-7
    assert np.array_equal(kernel(w, x, threads=2), y)
    assert kernel.prepack_operand(0) is None and kernel.prepack_operand(1) is None  # a conv's B is its input


# (images, C_in, C_out, H, W, kernel, stride, padding): odd planes and channel counts, 3x3 at
# stride 1 and 2, a 3x5 kernel with unequal strides and paddings, a 7x7 stem of 3 channels
AMX_CONVS = [(2, 5, 40, 9, 11, (3, 3), (1, 1), (1, 1)), (2, 7, 40, 10, 9, (3, 3), (2, 2), (1, 1)),
             (1, 3, 33, 13, 12, (3, 5), (2, 1), (0, 2)), (1, 3, 48, 17, 17, (7, 7), (2, 2), (3, 3))]


@needs_amx
@pytest.mark.parametrize("n,ci,co,h,w,kernel,stride,padding", AMX_CONVS)
def test_amx_convolution_on_its_gathered_im2col_equals_the_float64_convolution(n, ci, co, h, w, kernel, stride, padding):
    import torch

    op = _conv(n=n, ci=ci, co=co, h=h, w=w, kernel=kernel, stride=stride, padding=padding)
    wt, x = random_inputs(op, seed=n + ci + co)
    outs = {rows: compile_kernel(op, DirectSchedule(algo="amx", isa="avx512", rows=rows, vecs=32))(wt, x)
            for rows in (32, 64)}
    y = outs[32]
    w4, x4 = torch.from_numpy(wt.reshape(co, ci, *kernel)), torch.from_numpy(x.reshape(n, ci, h, w))
    exact = torch.nn.functional.conv2d(x4.double(), w4.double(), stride=stride, padding=padding).numpy()
    fp32 = torch.nn.functional.conv2d(x4, w4, stride=stride, padding=padding).numpy()
    got = y.reshape(exact.shape)
    scale = np.abs(exact).max()
    # the float32 tolerance of the GEMM tests: 2x a float32 convolution's error against float64
    assert np.abs(got - exact).max() / scale <= 2 * np.abs(fp32 - exact).max() / scale + 1e-7
    # A's rows in one block (64: each column pair's slice of B gathered where it is used) or two
    # (32: the image's B gathered and split whole first): the same bits; 2 threads as 1
    assert np.array_equal(outs[64], y)
    kernel64 = compile_kernel(op, DirectSchedule(algo="amx", isa="avx512", rows=64, vecs=32))
    assert np.array_equal(kernel64(wt, x, threads=2), y)


def test_amx_is_offered_for_plain_gemms_of_16_rows_or_more_where_it_runs(monkeypatch):
    monkeypatch.setattr(direct, "amx_ready", lambda: None)
    isas = ("avx2", "avx512")
    space = direct.amx_space(ops.gemm(300, 40, 1600, trans_b=True), isas)
    assert space and all(s.algo == "amx" and s.rows % 32 == 0 and s.vecs % 32 == 0 for s in space)
    # K cut into near-equal blocks: 1600 in blocks of at most 768 is 3 x 544 (533.3 up to 32), not 768 + 768 + 64
    assert {s.vecs for s in space} == {544, 320, 800}
    for op in (ops.gemm(15, 64, 64), ops.gemm(64, 64, 64, trans_a=True), ops.batched_gemm(2, 64, 64, 64)):
        assert direct.amx_space(op, isas) == []
    assert direct.amx_space(ops.gemm(64, 64, 64), ("avx2",)) == []  # the split runs on AVX-512
    # a convolution of one group is GEMMs (strided and padded ones on their gathered im2col
    # matrix); a grouped one, or one of fewer than 16 output channels (A's rows), is not
    for conv in (_conv(), _conv(stride=(2, 2)), _conv(padding=(1, 1)), _conv(kernel=(3, 3), padding=(1, 1))):
        assert direct.amx_space(conv, isas)
    for conv in (_conv(groups=2), _conv(co=8)):
        assert direct.amx_space(conv, isas) == []
    monkeypatch.setattr(direct, "amx_ready", lambda: "this CPU lacks amx_tile")
    assert direct.amx_space(ops.gemm(64, 64, 64), isas) == []


def test_amx_schedule_round_trips_and_the_model_prices_it():
    s = DirectSchedule(algo="amx", isa="avx512", rows=128, vecs=768)
    assert schedule_from_dict(json.loads(s.key())) == s and s.short() == "amx bf16x6 mb128 kc768"
    # the Intel VM's figures, by hand (the model needs an AVX-512 peak, which an AVX2 machine lacks)
    machine = Machine(
        isa="avx512", cores=2, cache_bytes={"L1": 48 << 10, "L2": 2 << 20, "L3": 480 << 20},
        cache_shared_by={"L1": 1, "L2": 1, "L3": 2}, peak_flops={"avx512": {1: 222e9, 2: 448e9}},
        read_bw={"L1": {1: 358e9, 2: 691e9}, "L2": {1: 188e9, 2: 373e9}, "L3": {1: 9.6e9, 2: 22.2e9},
                 "DRAM": {1: 10.3e9, 2: 21.6e9}},
        write_bw={1: 10e9, 2: 20e9}, fingerprint="amx-tests", isas=("avx512",),
    )
    small, big = predict(ops.gemm(64, 768, 768), s, machine), predict(ops.gemm(2048, 768, 768), s, machine)
    assert 0 < small < big  # 32x the work costs more, not 32x less
    # no more than the tile products at the documented rate allow (16 cycles a product)
    assert big > 2 * 2048 * 768 * 768 / (machine.peak(1, "avx512") * 1024 / 6 / 64)


def test_amx_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="avx512"):
        DirectSchedule(algo="amx", isa="avx2", rows=128, vecs=768)
    with pytest.raises(ValueError, match="multiples of 32"):
        DirectSchedule(algo="amx", isa="avx512", rows=100, vecs=768)
    conv = ops.conv2d(ops.Conv2dShape(batch=1, in_channels=8, out_channels=8, height=8, width=8, kernel=(3, 3),
                                      padding=(1, 1), groups=2))
    with pytest.raises(ValueError, match="gemm_nn or gemm_nt"):
        direct.generate_direct(conv, DirectSchedule(algo="amx", isa="avx512", rows=32, vecs=32))
