"""The direct kernels (depthwise and flat convolution in both orientations, grouped convolution, matrix-vector product) against the float64
reference within the float32 error bound of their sums, on odd shapes (rows and columns
that no register block divides, strides, asymmetric padding-free and padded kernels, a
channel multiplier), bit for bit the same at 1 and 2 threads, and offered by the tuner."""

import ctypes

import numpy as np
import pytest
from kernel_checks import assert_prepacked_weight_agrees, assert_within_bound, random_inputs, run

from tessera.kernels import compile_kernel, ops
from tessera.kernels.direct import (
    depthwise_of,
    direct_space,
    dwc_of,
    flat_of,
    flatcl_k_block,
    gemv_of,
    grouped_of,
)
from tessera.kernels.machine import cpu_isas
from tessera.kernels.schedule import DirectSchedule
from tessera.kernels.tuner import rank

ISAS = tuple(cpu_isas())

DEPTHWISE = [
    ops.Conv2dShape(batch=2, in_channels=6, out_channels=6, height=13, width=19, kernel=(3, 3), padding=(1, 1), groups=6),
    ops.Conv2dShape(batch=1, in_channels=5, out_channels=5, height=17, width=23, kernel=(7, 7), padding=(3, 3), groups=5),
    ops.Conv2dShape(batch=1, in_channels=4, out_channels=4, height=15, width=21, kernel=(3, 3), stride=(2, 2),
                    padding=(1, 1), groups=4),
    ops.Conv2dShape(batch=1, in_channels=3, out_channels=3, height=11, width=40, kernel=(5, 3), stride=(1, 3),
                    padding=(2, 0), groups=3),
    # stride 2 on rows of 71 and 40 columns: the plane's vector split by parity (32 columns at a
    # time, then a scalar tail), from an odd (padding 1) and an even (padding 2) first column
    ops.Conv2dShape(batch=1, in_channels=2, out_channels=2, height=9, width=71, kernel=(3, 3), stride=(2, 2),
                    padding=(1, 1), groups=2),
    ops.Conv2dShape(batch=1, in_channels=2, out_channels=2, height=6, width=40, kernel=(5, 5), stride=(2, 2),
                    padding=(2, 2), groups=2),
    # a channel multiplier (2 outputs per input channel) and one input channel (a stem)
    ops.Conv2dShape(batch=2, in_channels=3, out_channels=6, height=9, width=9, kernel=(3, 3), padding=(1, 1), groups=3),
    ops.Conv2dShape(batch=1, in_channels=1, out_channels=5, height=10, width=33, kernel=(3, 3), padding=(1, 1)),
    # a network's last stage in small: 7x7 planes, channels that fill no whole vector (21 = 16 + 5,
    # 8 + 8 + 5), the row's one block overlapping none or the one before it
    ops.Conv2dShape(batch=1, in_channels=21, out_channels=21, height=7, width=7, kernel=(7, 7), padding=(3, 3), groups=21),
    # a row stride unlike the column stride, a 3x5 kernel with padding on columns only, two images
    ops.Conv2dShape(batch=2, in_channels=35, out_channels=35, height=9, width=10, kernel=(3, 5), stride=(2, 1),
                    padding=(0, 2), groups=35),
]


@pytest.mark.parametrize("s", DEPTHWISE, ids=lambda s: s.label())
@pytest.mark.parametrize("isa", ISAS)
def test_depthwise_kernel_within_bound_and_thread_invariant(s, isa):
    op = ops.conv2d(s)
    d = depthwise_of(op)
    assert (d.sh, d.sw, d.ph, d.pw) == (*s.stride, *s.padding)
    inputs = random_inputs(op, seed=3)
    outs = []
    for rows, vecs in ((1, 1), (3, 2)):  # 3 rows: a block past the last output row
        kernel = compile_kernel(op, DirectSchedule(algo="depthwise", isa=isa, rows=rows, vecs=vecs))
        for threads in (1, 2):
            out = run(kernel, op, inputs, threads)
            assert_within_bound(out, op, inputs)
            outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])  # threads take whole planes: the same sums
    np.testing.assert_array_equal(outs[2], outs[3])
    # dwc (channels on the lanes; one output channel a group) sums every output's taps in the
    # same order (rows, then columns, from zero): the same bits, at 1 and 2 threads
    for rows in (2, 7) if dwc_of(op) is not None else ():  # 7: a block that overlaps the one before it
        if rows > d.ow:
            continue
        kernel = compile_kernel(op, DirectSchedule(algo="dwc", isa=isa, rows=rows, vecs=1))
        for threads in (1, 2):
            np.testing.assert_array_equal(run(kernel, op, inputs, threads), outs[0])


GROUPED = [
    # ResNeXt-like (4 in, 4 out per group), odd plane
    ops.Conv2dShape(batch=2, in_channels=8, out_channels=8, height=13, width=19, kernel=(3, 3), padding=(1, 1), groups=2),
    # stride 2, unequal in/out per group (3 in, 6 out), a 5x3 kernel without padding on one axis
    ops.Conv2dShape(batch=1, in_channels=9, out_channels=18, height=15, width=21, kernel=(5, 3), stride=(2, 2),
                    padding=(0, 1), groups=3),
]


@pytest.mark.parametrize("s", GROUPED, ids=lambda s: s.label())
@pytest.mark.parametrize("isa", ISAS)
def test_grouped_kernel_within_bound_and_thread_invariant(s, isa):
    op = ops.conv2d(s)
    d = grouped_of(op)
    assert (d.g, d.cig, d.cog) == (s.groups, s.in_channels // s.groups, s.out_channels // s.groups)
    assert depthwise_of(op) is None
    inputs = random_inputs(op, seed=4)
    for rows, vecs in ((1, 1), (3, 2)):
        kernel = compile_kernel(op, DirectSchedule(algo="grouped", isa=isa, rows=rows, vecs=vecs))
        one, two = run(kernel, op, inputs, 1), run(kernel, op, inputs, 2)
        assert_within_bound(one, op, inputs)
        np.testing.assert_array_equal(one, two)  # each output plane summed in one thread, in one order


FLAT = [
    # one group, stride 1: rows of 19 (so the flat positions of a block cross several rows), 2 images
    ops.Conv2dShape(batch=2, in_channels=5, out_channels=8, height=13, width=19, kernel=(3, 3), padding=(1, 1)),
    # stride 2 on odd and even planes, a 5x3 kernel with padding on one axis only
    ops.Conv2dShape(batch=1, in_channels=3, out_channels=4, height=15, width=21, kernel=(5, 3), stride=(2, 2),
                    padding=(0, 1)),
    ops.Conv2dShape(batch=1, in_channels=6, out_channels=16, height=10, width=40, kernel=(3, 3), stride=(2, 2),
                    padding=(1, 1)),
    # a 7x7 stride-2 stem (3 input channels, padding 3) and a grouped conv (3 groups of 4 in, 8 out)
    ops.Conv2dShape(batch=1, in_channels=3, out_channels=8, height=23, width=17, kernel=(7, 7), stride=(2, 2),
                    padding=(3, 3)),
    ops.Conv2dShape(batch=2, in_channels=12, out_channels=24, height=7, width=7, kernel=(3, 3), padding=(1, 1),
                    groups=3),
    # stride 1 on rows and 2 on columns
    ops.Conv2dShape(batch=1, in_channels=2, out_channels=4, height=9, width=30, kernel=(3, 3), stride=(1, 2),
                    padding=(1, 1)),
]


def _within_bound_thread_invariant_and_kept(op, inputs, schedule: DirectSchedule):
    """The kernel on 1 and 2 threads: within the float32 bound, the same bits (each output summed in
    one thread, in one order), and a second call (the kept planes, the kept weight) agrees."""
    kernel = compile_kernel(op, schedule)
    one, two = run(kernel, op, inputs, 1), run(kernel, op, inputs, 2)
    assert_within_bound(one, op, inputs)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(run(kernel, op, inputs, 1), one)
    return kernel, one


@pytest.mark.parametrize("s", FLAT, ids=lambda s: s.label())
@pytest.mark.parametrize("isa", ISAS)
def test_flat_kernel_within_bound_and_thread_invariant(s, isa):
    op = ops.conv2d(s)
    d = flat_of(op)
    assert (d.sh, d.sw, d.ph, d.pw, d.g) == (*s.stride, *s.padding, s.groups)
    inputs = random_inputs(op, seed=6)
    wide = (8, 2) if d.cog % 8 == 0 and isa == "avx512" else (4, 3) if isa == "avx512" else (4, 2)  # 16 registers on AVX2
    for rows, vecs in ((4, 1), wide):
        _within_bound_thread_invariant_and_kept(op, inputs, DirectSchedule(algo="flat", isa=isa, rows=rows, vecs=vecs))


FLATC = [
    # 3 groups of 8 in, 16 out on 7x7 planes: a 14-position tile is two rows of 7; K = 72
    ops.Conv2dShape(batch=2, in_channels=24, out_channels=48, height=7, width=7, kernel=(3, 3), padding=(1, 1),
                    groups=3),
    # stride 2, a 5x3 kernel padded on one axis: rows of 11 outputs, so a row's last 7-tile overlaps the first
    ops.Conv2dShape(batch=1, in_channels=5, out_channels=32, height=15, width=21, kernel=(5, 3), stride=(2, 2),
                    padding=(0, 1)),
    # K = 48 x 9 = 432: several k blocks (their partial sums kept per tile), on 7x7 planes whose last row
    # tile of two rows overlaps the one before it; one image in one band of rows, so each block of
    # output channels is read by one item, which transposes its weight slice by slice (FC_WFUSE,
    # the next slice prefetched on the way): the prepacked check below compares the two paths
    ops.Conv2dShape(batch=1, in_channels=48, out_channels=32, height=7, width=7, kernel=(3, 3), padding=(1, 1)),
    # stride 1 on rows and 2 on columns, rows of 15 outputs
    ops.Conv2dShape(batch=1, in_channels=6, out_channels=16, height=9, width=30, kernel=(3, 3), stride=(1, 2),
                    padding=(1, 1)),
    # 1x1 on 7x7 planes, K = 200 input channels: flatcl's k blocks of 80, 80 and 40 (each block's
    # planes held to 16 KiB), flatc's one block
    ops.Conv2dShape(batch=1, in_channels=200, out_channels=16, height=7, width=7, kernel=(1, 1)),
]


@pytest.mark.parametrize("s", FLATC, ids=lambda s: s.label())
@pytest.mark.parametrize("isa", ISAS)
def test_flatc_kernel_within_bound_thread_invariant_and_prepacked(s, isa):
    op = ops.conv2d(s)
    d = flat_of(op)
    inputs = random_inputs(op, seed=7)
    lanes = 16 if isa == "avx512" else 8
    offered = {(b.rows, b.vecs) for b in direct_space(op, isas=(isa,)) if b.algo == "flatc"}
    # 14 positions: one tile of a row of 15, two rows of 7, not offered on rows of 11 (not whole rows)
    blocks = [b for b in ((7, 1), (14, 1), (7, 2)) if b in offered]
    assert (7, 1) in blocks and ((14, 1) in blocks) == (d.ow >= 14 or d.ow == 7)
    for rows, vecs in blocks:
        assert d.cog % (vecs * lanes) == 0
        kernel, one = _within_bound_thread_invariant_and_kept(
            op, inputs, DirectSchedule(algo="flatc", isa=isa, rows=rows, vecs=vecs))
        assert_prepacked_weight_agrees(kernel, op, inputs, one)  # the weight transposed once at bind


@pytest.mark.parametrize("s", FLATC, ids=lambda s: s.label())
@pytest.mark.parametrize("isa", ISAS)
def test_flatcl_kernel_within_bound_thread_invariant_and_prepacked(s, isa):
    """flatc's orientation with tiles of consecutive positions across row ends: planes of 49, 66,
    49, 135 and 49 positions, each one no multiple of a tile taken (5, 6, 12 or 14 positions), so
    a last tile overlaps the one before it and the tiles cross rows at every offset."""
    op = ops.conv2d(s)
    d = flat_of(op)
    inputs = random_inputs(op, seed=8)
    offered = [(b.rows, b.vecs) for b in direct_space(op, isas=(isa,)) if b.algo == "flatcl"]
    assert offered and all(d.cog % (v * (16 if isa == "avx512" else 8)) == 0 for _, v in offered)
    # the tile of most vectors (then rows) and the one of most rows the registers hold
    picked = {max(offered, key=lambda b: (b[1], b[0])), max(offered)}
    assert any((d.oh * d.ow) % rows for rows, _ in picked)  # an overlapping last tile
    for rows, vecs in sorted(picked):
        kernel, one = _within_bound_thread_invariant_and_kept(
            op, inputs, DirectSchedule(algo="flatcl", isa=isa, rows=rows, vecs=vecs))
        assert_prepacked_weight_agrees(kernel, op, inputs, one)
        # the model prices the k blocks the kernel takes
        lanes = vecs * (16 if isa == "avx512" else 8)
        assert ctypes.c_long.in_dll(kernel._lib, "tk_flat_kc").value == flatcl_k_block(d, lanes)


# (1, 40, 1): one row of B, so the first of the TB-0 kernel's two parts of k is empty
GEMV = [(1, 37, 29, False), (1, 200, 77, False), (1, 40, 1, False), (1, 45, 300, True), (1, 129, 64, True)]


@pytest.mark.parametrize("m, n, k, trans_b", GEMV)
@pytest.mark.parametrize("isa", ISAS)
def test_gemv_kernel_within_bound_and_thread_invariant(m, n, k, trans_b, isa):
    op = ops.gemm(m, n, k, trans_b=trans_b)
    assert gemv_of(op).trans_b == trans_b
    inputs = random_inputs(op, seed=5)
    for rows, vecs in ((4, 2), (6, 1)) if trans_b else ((4, 2), (8, 1)):  # k tails, n tails
        kernel = compile_kernel(op, DirectSchedule(algo="gemv", isa=isa, rows=rows, vecs=vecs))
        one = run(kernel, op, inputs, 1)
        assert_within_bound(one, op, inputs)
        for threads in (2, 3, 4):  # threads take parts of k, then columns (TB 0): one order whatever their count
            np.testing.assert_array_equal(one, run(kernel, op, inputs, threads))


def test_direct_kernels_are_offered_only_where_they_apply(machine):
    dw = ops.conv2d(DEPTHWISE[0])
    dense = ops.conv2d(ops.Conv2dShape(batch=1, in_channels=4, out_channels=4, height=8, width=8, kernel=(3, 3)))
    assert {s.algo for s in direct_space(dw, isas=ISAS)} == {"depthwise", "dwc"}
    # a channel multiplier of 2: the depthwise kernel's only (dwc takes one output channel a group)
    assert {s.algo for s in direct_space(ops.conv2d(DEPTHWISE[6]), isas=ISAS)} == {"depthwise"}
    # no dwc block wider than a row of 3 outputs, none whose sums and weights overflow the registers
    narrow = ops.conv2d(ops.Conv2dShape(batch=1, in_channels=8, out_channels=8, height=3, width=3, kernel=(3, 3),
                                        padding=(1, 1), groups=8))
    assert {s.rows for s in direct_space(narrow, isas=ISAS) if s.algo == "dwc"} == {2}
    assert all(s.rows + 7 + 1 <= (32 if s.isa == "avx512" else 16)
               for s in direct_space(ops.conv2d(DEPTHWISE[-2]), isas=ISAS) if s.algo == "dwc")
    assert {s.algo for s in direct_space(ops.conv2d(GROUPED[0]), isas=ISAS)} == {"grouped", "flat"}
    assert {s.algo for s in direct_space(dense, isas=ISAS)} == {"flat"}
    # stride 3: not the flat kernel's (its phase planes take strides 1 and 2)
    strided = ops.conv2d(ops.Conv2dShape(batch=1, in_channels=4, out_channels=4, height=9, width=9, kernel=(3, 3),
                                         stride=(3, 3)))
    assert direct_space(strided, isas=ISAS) == []
    assert direct_space(ops.gemm(2, 64, 64), isas=ISAS) == []
    assert {s.algo for s in direct_space(ops.gemm(1, 64, 64), isas=ISAS)} == {"gemv"}
    ranked = rank(dw, threads=1, machine=machine)
    assert any(t.schedule.kind == "direct" for t in ranked)
    assert all(t.predicted > 0 for t in ranked)


def test_a_direct_schedule_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="direct kernel 'winograd'"):
        DirectSchedule(algo="winograd")
    with pytest.raises(ValueError, match=r"needs \d+ vector registers; avx2 has 16"):
        DirectSchedule(algo="depthwise", isa="avx2", rows=4, vecs=8)
    dense = ops.conv2d(ops.Conv2dShape(batch=1, in_channels=4, out_channels=4, height=8, width=8, kernel=(3, 3)))
    with pytest.raises(ValueError, match="one input channel per group"):
        compile_kernel(dense, DirectSchedule(algo="depthwise"))
    with pytest.raises(ValueError, match="groups of several input channels"):
        compile_kernel(dense, DirectSchedule(algo="grouped"))
    with pytest.raises(ValueError, match="dwc kernel takes a conv2d with one input and one output channel a group"):
        compile_kernel(dense, DirectSchedule(algo="dwc", rows=2, vecs=1))
    with pytest.raises(ValueError, match="dwc kernel takes a conv2d with one input and one output channel a group"):
        compile_kernel(ops.conv2d(DEPTHWISE[6]), DirectSchedule(algo="dwc", rows=2, vecs=1))
    seven_dw = ops.conv2d(DEPTHWISE[-2])  # rows of 7 outputs, a 7x7 kernel
    with pytest.raises(ValueError, match="a block of 8 positions is wider than the 7 of an output row"):
        compile_kernel(seven_dw, DirectSchedule(algo="dwc", rows=8, vecs=1))
    wide = ops.conv2d(ops.Conv2dShape(batch=1, in_channels=8, out_channels=8, height=9, width=20, kernel=(9, 9),
                                      padding=(4, 4), groups=8))
    with pytest.raises(ValueError, match="8 sums, 9 weights and an input need 18 vector registers; avx2 has 16"):
        compile_kernel(wide, DirectSchedule(algo="dwc", isa="avx2", rows=8, vecs=1))
    with pytest.raises(ValueError, match="one vector of channels a position"):
        compile_kernel(seven_dw, DirectSchedule(algo="dwc", rows=2, vecs=2))
    with pytest.raises(ValueError, match="3 rows must divide the 4 output channels"):
        compile_kernel(dense, DirectSchedule(algo="flat", rows=3, vecs=1))
    with pytest.raises(ValueError, match="several input channels a group, stride 1 or 2"):
        compile_kernel(ops.conv2d(DEPTHWISE[0]), DirectSchedule(algo="flat"))
    with pytest.raises(ValueError, match=r"flatc kernel: 1 vectors \(8 lanes\) must divide the 4 output channels"):
        compile_kernel(dense, DirectSchedule(algo="flatc", rows=7, vecs=1))
    seven = ops.conv2d(FLATC[0])  # rows of 7 outputs
    with pytest.raises(ValueError, match="a tile of 8 positions on rows of 7 must be whole rows"):
        compile_kernel(seven, DirectSchedule(algo="flatc", isa="avx2", rows=8, vecs=1))
    big = ops.conv2d(ops.Conv2dShape(batch=1, in_channels=4, out_channels=8, height=56, width=56, kernel=(3, 3),
                                     padding=(1, 1)))
    with pytest.raises(ValueError, match=r"flatcl kernel: a plane of 56x56 positions must hold a tile of 6 and its "
                                         r"sums \(8 channels a position\) at most 16384 floats"):
        compile_kernel(big, DirectSchedule(algo="flatcl", isa="avx2", rows=6, vecs=1))
    with pytest.raises(ValueError, match="constant=1 cannot be prepacked"):
        compile_kernel(seven, DirectSchedule(algo="flatc", isa="avx2", rows=7, vecs=1)).bind(
            *random_inputs(seven, seed=1).values(), constant=1)
