"""Generated GEMM kernels against the float64 reference within the float32 error bound of
their reduction length (conftest.error_bound), over odd shapes (1, primes, tails that no
register or cache tile divides), every transposition, batches, each loop order, packing
on and off, every parallel loop; and bit-identical results for one binary."""

import ctypes
import dataclasses

import numpy as np
import pytest
from kernel_checks import assert_within_bound, random_inputs, run

from tessera.kernels import compile_kernel, ops
from tessera.kernels.kernel import aligned_empty
from tessera.kernels.machine import cpu_isas
from tessera.kernels.schedule import GemmSchedule, LoopSchedule

SMALL = dict(mc=12, nc=32, kc=8)  # blocks far smaller than the shapes: every loop and tail runs

CASES = [
    (ops.gemm(1, 1, 1), GemmSchedule()),
    (ops.gemm(7, 13, 5), GemmSchedule()),
    (ops.gemm(37, 29, 67), GemmSchedule(**SMALL)),
    (ops.gemm(37, 29, 67), GemmSchedule(**SMALL, order="ic,pc,jc", inner="ir,jr")),
    (ops.gemm(37, 29, 67), GemmSchedule(**SMALL, pack_a=False, pack_b=False, unroll=1)),
    (ops.gemm(23, 41, 19, trans_a=True), GemmSchedule(mc=12, nc=48, kc=8, mr=4, nr=24, pack_a=False)),
    (ops.gemm(23, 41, 19, trans_b=True), GemmSchedule(mc=16, nc=32, kc=8, mr=8, nr=8)),
    (ops.gemm(23, 41, 19, trans_a=True, trans_b=True), GemmSchedule(**SMALL, order="ic,pc,jc")),
    (ops.batched_gemm(3, 11, 17, 13), GemmSchedule(**SMALL, fuse_n=False)),
    (ops.batched_gemm(3, 11, 17, 13, trans_b=True), GemmSchedule(mc=12, nc=16, kc=5, parallel="batch")),
]


@pytest.mark.parametrize("op,schedule", CASES, ids=lambda x: x.name if hasattr(x, "axes") else x.short())
def test_gemm_within_error_bound(op, schedule):
    inputs = random_inputs(op)
    assert_within_bound(run(compile_kernel(op, schedule), op, inputs), op, inputs)


@pytest.mark.parametrize("parallel", ["ic", "jc", "jr", "ir"])
def test_parallel_loops_agree_bit_for_bit(parallel):
    """Reductions never cross threads, so 1 and 2 threads give the very same bits; and one
    binary called twice at one thread count repeats itself."""
    op = ops.gemm(53, 47, 31)
    schedule = GemmSchedule(mc=12, nc=16, kc=8, parallel=parallel)
    kernel, inputs = compile_kernel(op, schedule), random_inputs(op, seed=3)
    one, two, again = run(kernel, op, inputs, 1), run(kernel, op, inputs, 2), run(kernel, op, inputs, 2)
    assert_within_bound(two, op, inputs)
    assert np.array_equal(one, two) and np.array_equal(two, again)


@pytest.mark.parametrize("parallel,order,inner", [
    ("jr", "ic,pc,jc", "ir,jr"), ("ic", "jc,pc,ic", "jr,ir"), ("ir", "ic,pc,jc", "jr,ir"), ("jr", "jc,pc,ic", "ir,jr"),
])
def test_shared_blocks_are_repacked_only_once_every_thread_is_done(parallel, order, inner):
    """The parallel loop ends without a barrier (each thread owns the same C tiles in every
    pass), so only the barrier before a shared block's repacking keeps a thread from
    overwriting a block the other still reads: 29 k blocks, each repacked, 20 calls on 2
    threads, every one the 1-thread bits. Without that barrier the first two fail every call."""
    op = ops.gemm(42, 96, 203)
    schedule = GemmSchedule(mc=42, nc=96, kc=7, order=order, inner=inner, parallel=parallel)
    kernel, inputs = compile_kernel(op, schedule), random_inputs(op, seed=5)
    one = run(kernel, op, inputs, 1)
    assert all(np.array_equal(one, run(kernel, op, inputs, 2)) for _ in range(20))


@pytest.mark.skipif("avx512" not in cpu_isas(), reason="this CPU has no AVX-512")
def test_avx512_micro_kernel():
    op = ops.gemm(31, 67, 45)
    inputs = random_inputs(op)
    for mr, nr in ((14, 32), (6, 64)):
        kernel = compile_kernel(op, GemmSchedule(isa="avx512", mr=mr, nr=nr, mc=2 * mr, nc=nr, kc=16))
        assert_within_bound(run(kernel, op, inputs), op, inputs)


def test_gemm_as_a_plain_loop_nest():
    op = ops.gemm(9, 21, 7)
    inputs = random_inputs(op)
    for s in (LoopSchedule(order=("m", "k", "n")), LoopSchedule(order=("m", "k", "n"), unroll=4),
              LoopSchedule(order=("m", "n", "k")), LoopSchedule(order=("m", "n", "k"), vectorize=False, unroll=4),
              LoopSchedule(order=("m.o", "n", "m.i", "k"), tiles=(("m", 4),), parallel=1)):
        assert_within_bound(run(compile_kernel(op, s), op, inputs, threads=2), op, inputs)


@pytest.mark.parametrize("op,schedule", [
    (ops.gemm(37, 29, 67), GemmSchedule(**SMALL)),
    (ops.gemm(37, 29, 67), GemmSchedule(**SMALL, order="ic,pc,jc", inner="ir,jr", parallel="ir")),
    (ops.gemm(23, 41, 19, trans_b=True), GemmSchedule(mc=16, nc=32, kc=8, mr=8, nr=8, parallel="jr")),
    (ops.gemm(23, 41, 19, trans_a=True), GemmSchedule(mc=12, nc=48, kc=5, mr=4, nr=24, parallel="jc")),
], ids=lambda x: x.name if hasattr(x, "axes") else x.short())
def test_a_constant_operand_packed_once_gives_the_same_bits(op, schedule):
    """A weight packed whole at bind (k block by k block, each block where the loops look for
    it; tails of K, M and N included) and read packed by every call: the same sums in the same
    order as packing it per call, so the same bits, at 1 and 2 threads, call after call."""
    kernel, inputs = compile_kernel(op, schedule), random_inputs(op, seed=5)
    plain = run(kernel, op, inputs, 2)
    for index in (0, 1):
        assert kernel.prepack_operand(index) == "AB"[index]
        for threads in (1, 2):
            call, out = kernel.bind(*[inputs[t.name] for t in op.inputs], threads=threads, constant=index)
            call()
            first = out.copy()
            call()
            assert np.array_equal(first, plain) and np.array_equal(out, plain)
            # the output a kernel allocates starts on a cache line, as torch's tensors do (16 bytes
            # off one, every vector store splits across two lines)
            assert out.ctypes.data % 64 == 0 and out.flags.c_contiguous and out.shape == plain.shape


def test_prepacking_what_cannot_be_packed_whole_is_refused():
    op = ops.batched_gemm(3, 11, 17, 13)
    kernel = compile_kernel(op, GemmSchedule(**SMALL, fuse_n=False))
    assert kernel.prepack_operand(1) is None  # a batch of weights: not one packed block
    with pytest.raises(ValueError, match="constant=1 cannot be prepacked"):
        kernel.bind(*random_inputs(op).values(), constant=1)
    unpacked = compile_kernel(ops.gemm(7, 13, 5), GemmSchedule(pack_b=False))
    assert unpacked.prepack_operand(1) is None and unpacked.prepack_operand(0) == "A"
    with pytest.raises(ValueError, match="constant=3"):
        unpacked.bind(*random_inputs(ops.gemm(7, 13, 5)).values(), constant=3)


@pytest.mark.parametrize("op,schedule", [
    (ops.gemm(37, 64, 45), GemmSchedule(mc=12, nc=32, kc=8, pack_b=False, prefetch_b=12)),
    (ops.gemm(19, 48, 23), GemmSchedule(mc=12, nc=16, kc=7, order="ic,pc,jc", inner="ir,jr", pack_b=False,
                                        parallel="jr")),
    (ops.batched_gemm(3, 11, 32, 13), GemmSchedule(mc=12, nc=16, kc=5, pack_b=False, fuse_n=False, prefetch_b=4)),
    # each row tile also fetching its share of the next B panel's rows (the last panel's next
    # lies past B's end: prefetches there are dropped, never a fault)
    (ops.gemm(37, 64, 45), GemmSchedule(mc=12, nc=32, kc=8, pack_b=False, prefetch_b=12, prefetch_next_b=True)),
    (ops.batched_gemm(3, 11, 32, 13), GemmSchedule(mc=12, nc=16, kc=5, pack_b=False, fuse_n=False,
                                                   prefetch_next_b=True)),
], ids=lambda x: x.name if hasattr(x, "axes") else x.short())
def test_b_read_in_place_when_its_rows_lie_on_cache_lines_else_packed(op, schedule):
    """A schedule that reads B in place has two runs, in place (B's start and rows on cache
    lines) and packing B (otherwise); tk_run picks one by where B lies. Both give the bits of
    the same blocking with B packed (the same sums in the same order; the prefetch ahead changes
    no value), for B on lines and B 16 bytes off them, at 1 and 2 threads."""
    inputs = random_inputs(op, seed=11)
    names = [t.name for t in op.inputs]
    packed = compile_kernel(op, dataclasses.replace(schedule, pack_b=True, prefetch_b=0, prefetch_next_b=False))
    want = run(packed, op, inputs)
    assert_within_bound(want, op, inputs)
    kernel = compile_kernel(op, schedule)
    b = names[1]
    lined = aligned_empty(inputs[b].shape)
    lined[...] = inputs[b]
    buf = aligned_empty((inputs[b].size + 16,))
    off = buf[4:4 + inputs[b].size].reshape(inputs[b].shape)  # 16 bytes past a line
    off[...] = inputs[b]
    assert lined.ctypes.data % 64 == 0 and off.ctypes.data % 64 == 16
    out = np.empty(op.output.tensor.shape, dtype=np.float32)
    for b_value in (lined, off):
        args = [inputs[names[0]], b_value]
        for threads in (1, 2):
            assert np.array_equal(kernel(*args, threads=threads), want), (threads, b_value.ctypes.data % 64)
            for path in ("tk_run_b_in_place", "tk_run_b_packed"):  # each run alone, wherever B lies
                fn = getattr(kernel._lib, path)
                fn.restype = None
                out.fill(np.nan)
                fn(*(ctypes.c_void_p(x.ctypes.data) for x in (out, *args)), ctypes.c_int(threads))
                assert np.array_equal(out, want), path


@pytest.mark.parametrize("order,inner,parallel,next_b", [
    ("ic,pc,jc", "jr,ir", "ic", False), ("jc,pc,ic", "ir,jr", "jr", False), ("jc,pc,ic", "jr,ir", "jc", False),
    ("ic,pc,jc", "ir,jr", "ir", False),
    # the panel's other tiles also fetching the next panel's rows from B (prefetch_next_b)
    ("ic,pc,jc", "jr,ir", "ic", True), ("jc,pc,ic", "jr,ir", "jc", True), ("ic,pc,jc", "jr,ir", "jr", True),
])
def test_b_packed_by_each_panels_first_tile_gives_the_bits_of_packing_first(order, inner, parallel, next_b):
    """With pack_b_first_tile, where the thread that packs a B panel is the only one reading
    it, the panel's first row tile packs it while it computes (tk_ukernel_packing_b; a tail panel
    is packed first, as before); under a parallel ir loop B is packed first. Either way the bits
    are those of B packed once, before any call (the same sums in the same order), at 1 and 2
    threads, with tails of rows, columns and k (29 x 53 x 37 in blocks of 12 x 32 x 8), calls
    repeated."""
    from tessera.kernels.codegen_gemm import packs_b_by_first_tile

    op = ops.gemm(29, 53, 37)
    schedule = GemmSchedule(mc=12, nc=32, kc=8, order=order, inner=inner, parallel=parallel, pack_b_first_tile=True,
                            prefetch_next_b=next_b)
    assert packs_b_by_first_tile(op, schedule) == (parallel != "ir")
    assert not packs_b_by_first_tile(op, dataclasses.replace(schedule, pack_b_first_tile=False, prefetch_next_b=False))
    inputs = random_inputs(op, seed=13)
    args = [inputs[t.name] for t in op.inputs]
    kernel = compile_kernel(op, schedule)
    call, want = kernel.bind(*args, threads=1, constant=1)
    call()
    assert_within_bound(want, op, inputs)
    for threads in (1, 2, 2):
        assert np.array_equal(kernel(*args, threads=threads), want), threads
