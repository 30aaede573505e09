"""The schedule space of an operator: every GemmSchedule the micro-kernel allows (when the
operator is a contraction), a family of loop-nest schedules (always) and the register blocks
of a direct kernel (when one applies), sized to the operator so that no tile is larger than
the work."""

from __future__ import annotations

import itertools

from tessera.kernels.codegen_loops import _Gen as _LoopGen
from tessera.kernels.codegen_loops import parallel_safe_axes
from tessera.kernels.contraction import NotTensorizable
from tessera.kernels.direct import direct_space
from tessera.kernels.ir import Operator, drop_unit_axes
from tessera.kernels.model import _facts
from tessera.kernels.schedule import REGISTER_TILES, GemmSchedule, LoopSchedule, Schedule

# mc up to the whole of M: with "ic,pc,jc" and "ir,jr" (BLIS's own mapping, A's micro-panel in L1
# against B's block in L2) a tall block of A is packed once per k block and B once in all;
# kc up to 1024: a K of 768 or 3072 in one or three blocks, C read and written that often;
# each target balanced over K (balanced_block)
MC_TARGETS = (48, 96, 192, 384, 1024, 4096)
NC_TARGETS = (256, 512, 1024, 4096)
KC_TARGETS = (128, 256, 384, 512, 768, 1024)


def _round(target: int, unit: int, limit: int) -> int:
    """A multiple of ``unit`` near ``target``, no larger than ``limit`` rounded up to ``unit``."""
    cap = -(-limit // unit) * unit
    return max(unit, min(cap, round(target / unit) * unit))


def balanced_block(target: int, size: int) -> int:
    """The block that cuts ``size`` into as many near-equal blocks as ``target`` would: K = 513
    in blocks of at most 512 is 257 + 256, not 512 + 1, whose sliver is a whole extra pass over
    C (and a packing) for one step of k (the probes on two machines: docs/kernels.md)."""
    blocks = -(-size // max(1, min(target, size)))
    return -(-size // blocks)


def gemm_space(op: Operator, *, threads: int, isas: tuple[str, ...], unrolls=(4,)) -> list[GemmSchedule]:
    try:
        variants = [(f, *_facts(op, f)) for f in (True, False)]
    except NotTensorizable:
        return []
    if variants[0][1].sizes == variants[1][1].sizes:
        variants = variants[:1]
    out = set()
    for (fuse, con, a_plain, b_plain, _), isa in itertools.product(variants, isas):
        BT, M, N, K = con.sizes
        # one thread: "ic" rather than "none" (the same speed: the loop's `omp for` on one thread),
        # so a binary tuned for one thread is the very binary a 2-thread tuning may pick (cache hit)
        pars = ("ic",) if threads == 1 else tuple(p for p in ("ic", "jc", "jr", "ir", "batch") if p != "batch" or BT > 1)
        for mr, nr in REGISTER_TILES[isa]:
            mcs = {_round(t, mr, M) for t in MC_TARGETS}
            if threads > 1:  # one block of A's rows a thread (OpenMP's static split then even)
                mcs |= {-(-M // (threads * mr)) * mr}
            ncs = {_round(t, nr, N) for t in NC_TARGETS}
            kcs = {balanced_block(t, K) for t in KC_TARGETS}
            for mc, nc, kc, order, inner, pa, pb, par, un in itertools.product(
                mcs, ncs, kcs, ("jc,pc,ic", "ic,pc,jc"), ("jr,ir", "ir,jr"),
                (True, False) if a_plain else (True,), (True, False) if b_plain else (True,), pars, unrolls
            ):
                out.add(GemmSchedule(isa=isa, mr=mr, nr=nr, mc=mc, nc=nc, kc=kc, order=order, inner=inner,
                                     pack_a=pa, pack_b=pb, unroll=un, parallel=par, fuse_n=fuse))
    return sorted(out, key=lambda s: s.key())


def _orders(op: Operator) -> list[tuple[str, ...]]:
    out_axes = [a.name for a in op.axes if a.name in op.output.axes]
    red = list(op.reduction_axes)
    orders = [tuple(out_axes[:-1] + red + out_axes[-1:]), tuple(out_axes + red)]
    if len(out_axes) >= 2:
        orders.append(tuple(out_axes[:-2] + red + out_axes[-2:]))
    return list(dict.fromkeys(o for o in orders if o))


def loop_space(op: Operator, *, threads: int, isas: tuple[str, ...]) -> list[LoopSchedule]:
    op = drop_unit_axes(op)
    safe = parallel_safe_axes(op)
    out = []
    for order, isa, unroll in itertools.product(_orders(op), isas[-1:], (1, 4)):
        pars = [0]
        if threads > 1:
            pars = [p for p in (1, 2) if p < len(order) and all(a in safe for a in order[:p])] or [0]
        for par in pars:
            try:
                s = LoopSchedule(order=order, parallel=par, unroll=unroll, isa=isa)
                _LoopGen(op, s)  # rejects what the generator cannot do
            except ValueError:
                continue
            out.append(s)
    return out


def schedule_space(op: Operator, *, threads: int, isas: tuple[str, ...]) -> list[Schedule]:
    """Every candidate schedule of ``op`` for ``threads`` threads and the given vector ISAs (the
    direct kernels' where one applies: their threads split the work by themselves)."""
    return [*gemm_space(op, threads=threads, isas=isas), *loop_space(op, threads=threads, isas=isas),
            *direct_space(op, isas=isas)]
