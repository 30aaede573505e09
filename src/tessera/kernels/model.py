"""The analytic performance model (swDNN's approach, on this CPU): a schedule's time from
the measured machine (peak FMA rate per ISA and thread count, bandwidth per level, cache
sizes) and counts derived from the operator and the schedule alone.

Micro-kernel schedules (BLIS's loops), per thread:

    compute  = padded FMAs / (peak x micro-kernel efficiency x balance)
    streams  = bytes each loop re-reads / bandwidth of the level that block lives in
               (A block per jr panel, B block per ic block, C per k block)
    packing  = elements packed x cycles per element + their bytes / source bandwidth
    time     = packing + max(compute, streams) + a fixed call cost

micro-kernel efficiency: its measured rate at that block depth kc and inner loop order
(``Machine.ukernel_flops``: the primitive timed over packed blocks, where its panels live
and its C tile's load/add/store per call included) over the peak;
without a measurement, an estimate from its issue (NR/VL vector loads + MR broadcasts, 2 a
cycle, against MR x NR/VL FMAs, 2 a cycle), latency (MR x NR/VL independent chains against
4 cycles x 2 pipes) and the C tile's cost per call; balance: the parallel
loop's trip count over the threads (the busiest thread decides). A block "lives" in the
smallest level it fits in (L1/L2 per core, L3 shared).

Loop-nest schedules: the innermost loop's issue rate (its loads and stores against the
FMA pipes, vector or scalar, its trip count against the vector length) and each cache
level's traffic from footprints (the data the loops inside a level touch, times the trips
of the loops outside it).

Direct kernels (``direct``; their terms in ``model_direct``): a depthwise or grouped convolution's register blocks (their FMAs against
their vector loads and broadcasts, two of each a cycle) plus the copy of each input plane
into its padded buffer (``dwc``: the transposed copies of a block of channels' planes,
weights and outputs), against the bytes of input, output and weights from the level they
fit in; a GEMV's matrix bytes from the level it fits in against its FMAs at the rate its
loads allow. Winograd (``winograd``): its transforms' vector work and scratch traffic plus
the GEMM model of its GEMMs.
"""

from __future__ import annotations

import functools
import math

from tessera.kernels.codegen_loops import _loops, unit_axes
from tessera.kernels.contraction import analyse
from tessera.kernels.ir import Operator, accesses, drop_unit_axes
from tessera.kernels.machine import Machine
from tessera.kernels.schedule import DirectSchedule, GemmSchedule, LoopSchedule, Schedule, WinogradSchedule

FMA_PIPES, FMA_LATENCY, LOADS_PER_CYCLE = 2, 4, 2
CALL_SECONDS = 4e-6  # entering the kernel and its OpenMP region
EXPOSED = 0.5  # the share of a stream from L3 or memory that overlap does not hide
REREAD_L2_SHARE = 0.5  # of L2 for a block re-read from it while A, B and C stream through it
PACK_CYCLES = {"rows": 0.3, "run": 0.6, "table": 3.0, "a": 1.0}  # per packed element


def _cycle(m: Machine, isa: str) -> float:
    """Seconds per cycle, from the measured peak (FMA_PIPES vector FMAs a cycle)."""
    vl = 16 if isa == "avx512" else 8
    return FMA_PIPES * vl * 2 / m.peak(1, isa)


def _level(m: Machine, nbytes: float, threads: int = 1, l2_share: float = 0.75) -> str:
    for level, share in (("L1", 0.75), ("L2", l2_share)):
        if nbytes <= share * m.cache_bytes[level]:
            return level
    return "L3" if nbytes * threads <= 0.75 * m.cache_bytes["L3"] else "DRAM"


def _bw(m: Machine, level: str, threads: int) -> float:
    """Bytes/s one thread gets from ``level`` when ``threads`` run."""
    return m.bandwidth(level, threads) / threads


def _balance(trips: int, threads: int) -> float:
    """Effective parallel speed-up of a loop of ``trips`` iterations."""
    return trips / math.ceil(trips / threads) if trips else 1.0


def _balance_blocks(extent: int, block: int, threads: int) -> float:
    """Effective parallel speed-up of a loop over ``extent`` in blocks of ``block`` (the last one
    what is left), split as OpenMP's static schedule splits it: the first ``trips % threads``
    threads take one block more. The work is the blocks' sizes, not their count: 512 rows in
    blocks of 384 give 384 rows to one thread and 128 to the other, a speed-up of 1.33 where
    counting blocks says 2."""
    trips = -(-extent // block)
    if trips <= 1 or threads <= 1:
        return 1.0
    sizes = [block] * (trips - 1) + [extent - block * (trips - 1)]
    q, r = divmod(trips, threads)
    start, most = 0, 0
    for t in range(min(threads, trips)):
        count = q + (t < r)
        most = max(most, sum(sizes[start:start + count]))
        start += count
    return extent / most


@functools.lru_cache(maxsize=256)
def _facts(op: Operator, fuse_n: bool):
    """The contraction, whether A / B may stay unpacked, and how B packs."""
    con = analyse(op, fuse_n=fuse_n)
    a_plain = None not in (con.scaled_flat(con.part(con.a, "m"), "m"), con.scaled_flat(con.part(con.a, "k"), "k"))
    guarded = bool(con.b.guarded_dims(con.op.extents))
    b_rows = con.scaled_flat(con.part(con.b, "n"), "n") == 1 and not guarded
    b_plain = b_rows and con.scaled_flat(con.part(con.b, "k"), "k") is not None
    kind = "rows" if b_rows else ("run" if _runs(con) else "table")
    return con, a_plain, b_plain, kind


def _estimated_efficiency(mr: int, nv: int, kc: int, tails: bool) -> float:
    fmas = mr * nv
    issue = fmas / max(fmas, (mr + nv) * FMA_PIPES / LOADS_PER_CYCLE)
    latency = min(1.0, fmas / (FMA_LATENCY * FMA_PIPES))
    k_cycles = fmas / FMA_PIPES
    store_cycles = 3 * fmas + 12 + (mr * nv * 0.4 if tails else 0)
    return issue * latency * kc * k_cycles / (kc * k_cycles + store_cycles)


def ukernel_efficiency(m: Machine, isa: str, mr: int, nr: int, kc: int, mc: int, nc: int, inner: str) -> float:
    """The micro-kernel's fraction of the FMA peak at block depth ``kc``: measured (linear in
    log kc between the measured depths), else estimated from its loads, FMAs and latency."""
    vl = 16 if isa == "avx512" else 8
    table = m.ukernel_flops.get(isa, {}).get(f"{mr}x{nr}|{inner}")
    if not table:
        return _estimated_efficiency(mr, nr // vl, kc, mc % mr != 0 or nc % nr != 0)
    kcs = sorted(table)
    lo = max([k for k in kcs if k <= kc] or kcs[:1])
    hi = min([k for k in kcs if k >= kc] or kcs[-1:])
    w = 0.0 if hi == lo else (math.log(kc) - math.log(lo)) / (math.log(hi) - math.log(lo))
    rate = (1 - w) * table[lo] + w * table[hi]
    return min(1.0, rate / m.peak(1, isa))


def predict_gemm(op: Operator, s: GemmSchedule, m: Machine, threads: int) -> float:
    con, a_plain, b_plain, b_kind = _facts(op, s.fuse_n)
    BT, M, N, K = con.sizes
    mr, nr = s.mr, s.nr
    mc, nc, kc = min(s.mc, -(-M // mr) * mr), min(s.nc, -(-N // nr) * nr), min(s.kc, K)
    pack_a, pack_b = s.pack_a or not a_plain, s.pack_b or not b_plain
    mp, np_ = -(-M // mr) * mr, -(-N // nr) * nr
    k_blocks, n_blocks, m_blocks = -(-K // kc), -(-N // nc), -(-M // mc)
    # how often each operand is walked from where it lives, packed or read in place: A once per
    # block of B's columns under "jc,pc,ic", B once per block of A's rows under "ic,pc,jc"
    a_times = n_blocks if s.order == "jc,pc,ic" else 1
    b_times = m_blocks if s.order == "ic,pc,jc" else 1
    cycle = _cycle(m, s.isa)
    par = s.parallel if threads > 1 else "none"
    extent, block = {"none": (1, 1), "batch": (BT, 1), "jc": (np_, nc), "ic": (mp, mc), "jr": (nc, nr),
                     "ir": (mc, mr)}[par]
    speed = _balance_blocks(extent, block, threads) if par != "none" else 1.0
    t_eff = max(1, threads if par != "none" else 1)
    # the micro-kernel: its measured rate at this depth, else the issue / latency estimate
    flops = 2.0 * BT * mp * np_ * K
    per_core = m.peak(t_eff, s.isa) / t_eff
    t_compute = flops / (per_core * ukernel_efficiency(m, s.isa, mr, nr, kc, mc, nc, s.inner) * speed)
    # re-read streams (bytes per thread)
    a_block, b_block = 4 * mc * kc, 4 * kc * nc
    inner_jr = s.inner == "jr,ir"
    # (bytes, the block they are read from): the inner loop's re-read block, the micro-panel
    # held across it (read again per call when it does not fit L1), the outer re-read, C
    if inner_jr:  # A block re-read per NR panel, B micro-panel across A's panels
        streams = [(4.0 * BT * mp * K * (np_ / nr), a_block, 1), (4.0 * BT * np_ * K * (mp / mr), 4 * kc * nr, 1)]
    else:
        streams = [(4.0 * BT * np_ * K * (mp / mr), b_block, 1), (4.0 * BT * mp * K * (np_ / nr), 4 * kc * mr, 1)]
    if s.order == "jc,pc,ic":
        streams.append((4.0 * BT * np_ * K * m_blocks, b_block, t_eff))
    else:
        streams.append((4.0 * BT * mp * K * n_blocks, a_block, t_eff))
    streams.append((4.0 * BT * M * N * (2 * k_blocks - 1), 4.0 * M * N * BT, 1))
    # an operand read in place (not packed) comes from where it lives a_times / b_times over, as
    # its packing would, and a parallel loop over the other operand's blocks has every thread
    # walk all of it (a packed operand's reads are the packing's, below)
    if not pack_a:
        every = (threads if par in ("jc", "jr") else 1) * a_times
        streams.append((4.0 * BT * M * K * every, 4.0 * con.a.tensor.numel, t_eff))
    if not pack_b:
        every = (threads if par in ("ic", "ir") else 1) * b_times
        streams.append((4.0 * BT * N * K * every, 4.0 * con.b.tensor.numel, t_eff))
    # a stream from a level the cores share (L3, memory) is only partly hidden under the FMAs:
    # EXPOSED of it adds to the time (on an Intel VM whose L3 runs at memory speed, 2048^3 with
    # B's 4 MiB block re-read per 192-row block of A ran at 0.80 of peak; with A's block
    # re-read per 480 columns of B, a third of the bytes, at 0.85)
    t_fast, t_slow = 0.0, 0.0
    for nbytes, block, sharers in streams:
        level = _level(m, block, sharers, l2_share=REREAD_L2_SHARE)
        t = nbytes / speed / _bw(m, level, t_eff)
        if level in ("L1", "L2"):
            t_fast = max(t_fast, t)
        else:
            t_slow += t
    t_streams = max(t_fast, t_slow)
    # packing
    t_pack = 0.0
    a_src = _level(m, 4.0 * con.a.tensor.numel)
    b_src = _level(m, 4.0 * con.b.tensor.numel)
    if pack_a:
        elems = BT * mp * K * a_times
        t_pack += elems * PACK_CYCLES["a"] * cycle + 4 * elems / _bw(m, a_src, t_eff)
    else:  # strided broadcasts: more address registers, some spills; rows may alias in cache
        rows = con.scaled_flat(con.part(con.a, "m"), "m")
        t_compute *= (1.0 + 0.1 * (mr > 4)) * _aliasing(rows, mr)
    if pack_b:  # under a parallel ir loop each thread packs all of B's block (codegen_gemm)
        elems = BT * np_ * K * b_times * (threads if par == "ir" else 1)
        t_pack += elems * PACK_CYCLES[b_kind] * cycle + 4 * elems / _bw(m, b_src, t_eff)
    else:  # the micro-panel's kc rows come from the matrix itself, a row stride apart
        t_compute *= 1.1 * _aliasing(con.scaled_flat(con.part(con.b, "k"), "k"), kc)
    pack_par = threads if par != "none" else 1
    return CALL_SECONDS + t_pack / pack_par + max(t_compute, t_streams) + EXPOSED * t_slow


ALIAS_BYTES = 4096  # rows this far apart map to the same L1 set (4K aliasing of loads, too)
ALIAS_PENALTY = 2.0  # measured: unpacked operands of 1024- and 2048-wide matrices ran 1.5-4x slower


def _aliasing(stride: int | None, rows: int) -> float:
    """Slow-down of reading ``rows`` rows ``stride`` floats apart straight from a matrix: when the
    stride is a multiple of 4 KiB every row falls in one cache set and more than the set's ways
    evict each other (an estimate; packing is what avoids it)."""
    if stride is None or rows <= 8:
        return 1.0
    return ALIAS_PENALTY if (4 * stride) % ALIAS_BYTES == 0 else 1.0


def _runs(con) -> bool:
    """Does B's N part step by a constant along the innermost N axis (so panels are runs)?"""
    last = con.n[-1].name if con.n else None
    return last is not None and con.b.offset().coeff(last) != 0


def _footprint(accs, loops_inside, extents) -> float:
    total = 0.0
    for acc in accs:
        elems = 1
        for idx in acc.index:
            span = 1 + sum(abs(c) * (extents[a] - 1) for a, c in idx.coeffs if a in loops_inside)
            elems *= span
        total += 4.0 * min(elems, acc.tensor.numel)
    return total


def predict_loops(op: Operator, s: LoopSchedule, m: Machine, threads: int) -> float:
    unit = unit_axes(op)
    op = drop_unit_axes(op)
    loops = _loops(op, s, unit)
    ext, tiles = op.extents, s.tile_of
    trips = [ext[lp.axis] if lp.kind == "full" else (
        -(-ext[lp.axis] // tiles[lp.axis]) if lp.kind == "outer" else tiles[lp.axis]) for lp in loops]
    inner = loops[-1].axis
    accs = accesses(op.body)
    unit = [a for a in accs if a.offset().coeff(inner) == 1]
    varying = [a for a in accs if a.offset().coeff(inner) != 0]
    out_varies = op.output.offset().coeff(inner) != 0
    vector = s.vectorize and len(unit) == len(varying) and (not out_varies or op.output.offset().coeff(inner) == 1)
    vl = (16 if s.isa == "avx512" else 8) if vector else 1
    loads = len(varying) + (1 if out_varies else 0)
    stores = 1 if out_varies else 0
    cycles = max(1.0 / FMA_PIPES, loads / LOADS_PER_CYCLE, float(stores)) + (0 if vector or loads <= 1 else 0.5 * loads)
    n_inner = trips[-1]
    fill = n_inner / (math.ceil(n_inner / vl) * vl)
    per_instance = 8 + 3 * len(loops)  # loop set-up and bound computations, in cycles
    instances = op.points / max(1, n_inner)
    par_trips = math.prod(trips[: s.parallel]) if s.parallel else 1
    speed = _balance(par_trips, threads) if s.parallel and threads > 1 else 1.0
    t_eff = threads if s.parallel and threads > 1 else 1
    cycle = _cycle(m, s.isa)
    t_compute = (op.points / vl / fill * cycles + instances * per_instance) * cycle / speed
    all_accs = [*accs, op.output]
    t_mem = 0.0
    for level, below in (("L1", "L2"), ("L2", "L3"), ("L3", "DRAM")):
        cap = 0.75 * m.cache_bytes[level] / (t_eff if level == "L3" else 1)
        cut = len(loops)
        for i in range(len(loops)):
            if _footprint(all_accs, {lp.axis for lp in loops[i:]}, ext) <= cap:
                cut = i
                break
        inside = {lp.axis for lp in loops[cut:]}
        bytes_in = _footprint(all_accs, inside, ext) * math.prod(trips[:cut])
        t_mem = max(t_mem, bytes_in / speed / _bw(m, below, t_eff))
    t_zero = 4.0 * op.output.tensor.numel / m.write_bw[min(m.write_bw)]
    return CALL_SECONDS + t_zero + max(t_compute, t_mem)


def predict(op: Operator, schedule: Schedule, m: Machine, threads: int = 1) -> float:
    """Predicted seconds of one call of ``op`` under ``schedule`` on ``threads`` threads."""
    if isinstance(schedule, GemmSchedule):
        return predict_gemm(op, schedule, m, threads)
    if isinstance(schedule, DirectSchedule):
        from tessera.kernels.model_direct import predict_direct  # it builds on this module's helpers

        return predict_direct(op, schedule, m, threads)
    if isinstance(schedule, WinogradSchedule):
        from tessera.kernels.winograd import predict_winograd  # it builds on this module's GEMM model

        return predict_winograd(op, schedule, m, threads)
    return predict_loops(op, schedule, m, threads)
