"""The performance model's direct-kernel terms (``tessera.kernels.direct``): depthwise and
grouped convolutions (``dw``, ``dwc``), flat direct convolutions (``flat``, ``flatc``,
``flatcl``), matrix-vector products (``gemv``) and the AMX GEMM (``amx``), each a schedule's
time from its register blocks' FMAs against their loads, its copies, and the bytes it moves
from the level they fit in, on the measured machine (``model``'s helpers: cycle time,
levels, bandwidths, thread balance)."""

from __future__ import annotations

from tessera.kernels.direct import (
    amx_of,
    amx_splits_where_used,
    conv_of,
    flat_positions,
    flatcl_k_block,
    gemv_of,
)
from tessera.kernels.ir import Operator
from tessera.kernels.machine import Machine
from tessera.kernels.model import CALL_SECONDS, FMA_PIPES, LOADS_PER_CYCLE, _balance, _bw, _cycle, _level
from tessera.kernels.schedule import DirectSchedule


def _predict_depthwise(op: Operator, s: DirectSchedule, m: Machine, threads: int) -> float:
    """Depthwise and grouped (the block's work once per input channel of the group)."""
    d = conv_of(op)
    vl = 16 if s.isa == "avx512" else 8
    chunk = s.vecs * vl
    qrows = (s.rows - 1) * d.sh + d.kh
    fmas = s.rows * d.kh * d.kw * s.vecs * d.cig
    loads = (qrows * d.kw * s.vecs + s.rows * d.kh * d.kw) * d.cig  # input vectors + weight broadcasts
    block_cycles = max(fmas, loads) / FMA_PIPES + s.rows * s.vecs + 6
    blocks = -(-d.oh // s.rows) * -(-d.ow // chunk)
    items, planes = d.n * d.g * d.cog, d.n * d.g * d.cig
    # the plane copy: a row memcpy (stride 1), a vector split by parity (stride 2, AVX-512), else scalar
    fill_cycles = d.h * d.w * (1.0 / vl if d.sw == 1 else 2.0 / vl if (d.sw == 2 and vl == 16) else 1.5)
    t_eff = max(1, min(threads, items))
    speed = _balance(items, t_eff)
    t_compute = (items * blocks * block_cycles + planes * fill_cycles) * _cycle(m, s.isa) / speed
    nbytes = 4.0 * (planes * d.h * d.w + items * (d.oh * d.ow + d.cig * d.kh * d.kw))
    t_mem = nbytes / m.bandwidth(_level(m, nbytes, t_eff), t_eff)
    return CALL_SECONDS + max(t_compute, t_mem)


# cycles a transposed element costs in tk_transpose's register blocks: 16 x 16 (AVX-512: 64
# two-source permutes a block on one port), 8 x 8 (AVX2: 24 unpacks, shuffles and lane swaps a
# block, one port on Intel, the edges one element at a time)
TRANSPOSE_CYCLES = {"avx512": 0.3, "avx2": 0.4}


def _predict_dwc(op: Operator, s: DirectSchedule, m: Machine, threads: int) -> float:
    """The channel-vectorised depthwise kernel: per block of ``rows`` outputs and kernel row,
    its FMAs against its loads (the row's weight vectors and the input columns the block
    reads, each once), for every block of every (image, channel block) item; plus the three
    transposed copies (the input planes in and the output out for every item, the weights in
    once per channel block and thread) in vector 16 x 16 blocks on AVX-512, one element at a
    time on AVX2."""
    d = conv_of(op)
    vl = 16 if s.isa == "avx512" else 8
    span = (s.rows - 1) * d.sw + d.kw
    row_cycles = max(s.rows * d.kw / FMA_PIPES, (d.kw + span) / LOADS_PER_CYCLE)
    block_cycles = d.kh * row_cycles + s.rows + 6
    channel_blocks = -(-d.g // vl)
    items = d.n * channel_blocks
    blocks = d.oh * -(-d.ow // s.rows)
    t_eff = max(1, min(threads, items))
    copies = vl * TRANSPOSE_CYCLES[s.isa] * (items * (d.h * d.w + d.oh * d.ow)
                                              + min(items, channel_blocks + t_eff - 1) * d.kh * d.kw)
    speed = _balance(items, t_eff)
    t_compute = (items * blocks * block_cycles + copies) * _cycle(m, s.isa) / speed
    nbytes = 4.0 * (d.n * d.g * (d.h * d.w + d.oh * d.ow) + d.g * d.kh * d.kw)
    t_mem = nbytes / m.bandwidth(_level(m, nbytes, t_eff), t_eff)
    return CALL_SECONDS + max(t_compute, t_mem)


def _predict_flat(op: Operator, s: DirectSchedule, m: Machine, threads: int) -> float:
    """The flat direct convolution: its tiles' FMAs (the dropped columns included) against their
    loads (a vector of positions per NV, a weight broadcast per row, each k), the plane copy, the
    weight streamed once per block of positions, and the scatter of the output."""
    d = conv_of(op)
    vl = 16 if s.isa == "avx512" else 8
    nr = s.vecs * vl
    blocks = -(-flat_positions(d) // nr)
    k = d.cig * d.kh * d.kw
    items = d.n * d.g * blocks
    step_cycles = max(s.rows * s.vecs / FMA_PIPES, (s.rows + s.vecs) / LOADS_PER_CYCLE)
    tile_cycles = k * step_cycles + 2 * s.rows * s.vecs * -(-k // 128)  # + the partial sums' store/add
    t_eff = max(1, min(threads, items))
    speed = _balance(items, t_eff)
    fill = d.n * d.g * d.cig * d.h * d.w * (1.0 / vl if d.sw == 1 else 2.0 / vl) + items * d.cog * nr
    t_compute = (items * (d.cog // s.rows) * tile_cycles + fill) * _cycle(m, s.isa) / speed
    weight = 4.0 * d.g * d.cog * k
    nbytes = 4.0 * (d.n * d.g * (d.cig * d.h * d.w + d.cog * d.oh * d.ow)) + weight * blocks * d.n
    t_mem = nbytes / m.bandwidth(_level(m, weight, t_eff), t_eff)
    return CALL_SECONDS + max(t_compute, t_mem)


def _predict_flatc(op: Operator, s: DirectSchedule, m: Machine, threads: int) -> float:
    """The channel-vectorised flat convolution: its tiles' FMAs (a row's overlapping last tile
    included) against their loads (NV weight vectors, MR position broadcasts, the k offset), the
    partial sums' store and reload per k block, the output's transposed copy, the plane copy and
    the weight's transposition (once a call before the tiles, or slice by slice beside them where
    each block of channels is read by one item; both transposes in vector 16 x 16 blocks on AVX-512)."""
    d = conv_of(op)
    vl = 16 if s.isa == "avx512" else 8
    nr = s.vecs * vl
    k = d.cig * d.kh * d.kw
    if s.algo == "flatcl":  # one band of linear tiles over the plane
        k_blocks = -(-k // flatcl_k_block(d, nr))
        tiles_row, row_tiles = -(-(d.oh * d.ow) // s.rows), 1
    else:
        kc_fit = 4096 // nr
        k_blocks = 1 if k <= kc_fit + kc_fit // 2 else -(-k // kc_fit)
        tc = min(s.rows, d.ow)  # a tile: tr rows of tc positions
        tr = s.rows // tc
        tiles_row, row_tiles = -(-d.ow // tc), -(-d.oh // tr)
    rb = max(1, min(row_tiles, 16384 // (tiles_row * s.rows * nr)))
    items = d.n * d.g * (d.cog // nr) * -(-row_tiles // rb)
    step_cycles = max(s.rows * s.vecs / FMA_PIPES, (s.rows + s.vecs + 1) / LOADS_PER_CYCLE)
    tile_cycles = k * step_cycles + 2 * s.rows * s.vecs * k_blocks + 6
    t_eff = max(1, min(threads, items))
    speed = _balance(items, t_eff)
    outputs = d.n * d.g * d.cog * d.oh * d.ow
    fill = d.n * d.g * d.cig * d.h * d.w * (1.0 / vl if d.sw == 1 else 2.0 / vl)
    tiles = d.n * d.g * (d.cog // nr) * row_tiles * tiles_row
    weight = d.g * d.cog * k
    t_compute = (tiles * tile_cycles + TRANSPOSE_CYCLES[s.isa] * outputs + fill) * _cycle(m, s.isa) / speed
    nbytes = 4.0 * (d.n * d.g * (d.cig * d.h * d.w + d.cog * d.oh * d.ow))
    if d.n * -(-row_tiles // rb) == 1:  # FC_WFUSE: each item transposes its slices as it goes, the weight streamed beside
        t_compute += weight * TRANSPOSE_CYCLES[s.isa] * _cycle(m, s.isa) / speed
        nbytes += 4.0 * weight
        t_pack = 0.0
    else:  # the whole weight read, written transposed and read again before the tiles
        t_pack = 8.0 * weight / m.bandwidth(_level(m, 8.0 * weight, t_eff), t_eff) + weight * TRANSPOSE_CYCLES[s.isa] * _cycle(m, s.isa) / t_eff
    t_mem = nbytes / m.bandwidth(_level(m, nbytes, t_eff), t_eff)
    return CALL_SECONDS + t_pack + max(t_compute, t_mem)


def _predict_gemv(op: Operator, s: DirectSchedule, m: Machine, threads: int) -> float:
    v = gemv_of(op)
    vl = 16 if s.isa == "avx512" else 8
    units = -(-v.n // (s.rows if v.trans_b else s.vecs * vl))
    t_eff = max(1, min(threads, units))
    # loads a vector FMA: the matrix's one, plus the vector's (TB 1) or y's load and store (TB 0) amortised
    per_fma = 1 + (1 / s.rows if v.trans_b else 2 / s.rows)
    fill = 1.0 if v.trans_b else v.n / (-(-v.n // (s.vecs * vl)) * s.vecs * vl)
    t_compute = 2.0 * v.n * v.k * per_fma / (m.peak(t_eff, s.isa) / t_eff * _balance(units, t_eff) * fill)
    nbytes = 4.0 * (v.n * v.k + v.n + v.k)
    t_mem = nbytes / m.bandwidth(_level(m, nbytes, t_eff), t_eff)
    return CALL_SECONDS + max(t_compute, t_mem)


# AMX (Intel's optimization manual): TDPBF16PS, a 16 x 16 tile of 32 products each, issues
# every 16 cycles; the kernel runs 24 of them per 32 x 32 block and k tile of 32 (six bfloat16
# products a float32 product, 2 x 2 accumulator tiles) and loads 20 tiles of 1 KiB for them
AMX_PRODUCT_CYCLES = 16
AMX_PRODUCTS_PER_BLOCK = 24
AMX_TILE_LOADS_PER_BLOCK = 20
AMX_SPLIT_BYTES = 10.0  # a float read (4 bytes) and its three bfloat16 parts written (6)
# a convolution's im2col value gathered (16 a masked vector gather, its tap's bounds compared):
# cycles a value, an estimate
AMX_GATHER_CYCLES = 1.0


def _predict_amx(op: Operator, s: DirectSchedule, m: Machine, threads: int) -> float:
    """The AMX GEMM: its tile products plus the tiles they load from L2 (a tile is not renamed:
    a load into it waits for its last reader, so loads and products do not overlap), or the
    packed B read again from beyond L2 for every block of ``s.rows`` rows when it does not stay
    in L2, whichever binds; plus B split and laid out per call at the bandwidth of its bytes read
    and written (the split's vector work costs about that), once, or once a row block where it is
    split a column pair's slice at a time where it is used (rows within one block, a batch, a
    convolution: no re-reads then), a convolution's B gathered from its images as it is split,
    A split once a call, block by block (the threads share both; a batch's images share it),
    and the partial sums of each k block written to C and read back."""
    g = amx_of(op)
    pairs = -(-g.n // 32)
    t_eff = max(1, min(threads, pairs))
    blocks = g.batch * -(-g.m // 32) * pairs * -(-g.k // 32)
    per_thread = blocks / _balance(pairs, t_eff)
    t_core = per_thread * (AMX_PRODUCTS_PER_BLOCK * AMX_PRODUCT_CYCLES * _cycle(m, "avx512")
                           + AMX_TILE_LOADS_PER_BLOCK * 1024 / _bw(m, "L2", t_eff))
    b_packed = 6.0 * pairs * 32 * -(-g.k // 32) * 32
    b_bw = m.bandwidth(_level(m, b_packed, t_eff), t_eff)
    row_blocks = -(-g.m // s.rows)
    # B split where it is used (a column pair's slice at a time): once a row block; else packed
    # whole once, then re-read per row block where it outgrows L2
    fused = amx_splits_where_used(g, s.rows)
    splits = row_blocks if fused else 1
    t_pack_b = splits * g.batch * AMX_SPLIT_BYTES * g.k * g.n / b_bw
    restreams = row_blocks - 1 if not fused and b_packed > 0.75 * m.cache_bytes["L2"] else 0
    t_stream = g.batch * restreams * b_packed / b_bw
    a_bytes = AMX_SPLIT_BYTES * g.m * g.k
    t_split_a = a_bytes / m.bandwidth(_level(m, a_bytes, t_eff), t_eff)  # once a call, a batch too
    c_bytes = 4.0 * g.batch * g.m * g.n
    t_c = (2 * -(-g.k // s.vecs) - 1) * c_bytes / m.bandwidth(_level(m, c_bytes, t_eff), t_eff)
    # a convolution's B gathered from its images as it is split
    gathers = 0 if g.conv is None else splits * g.k * g.n
    t_gather = gathers * AMX_GATHER_CYCLES * _cycle(m, "avx512") / t_eff
    return CALL_SECONDS + t_pack_b + t_split_a + t_c + t_gather + max(t_core, t_stream)


def predict_direct(op: Operator, s: DirectSchedule, m: Machine, threads: int = 1) -> float:
    """Predicted seconds of one call of a direct kernel."""
    predictor = {"gemv": _predict_gemv, "flat": _predict_flat, "flatc": _predict_flatc, "flatcl": _predict_flatc,
                 "dwc": _predict_dwc, "amx": _predict_amx}.get(s.algo, _predict_depthwise)
    return predictor(op, s, m, threads)
