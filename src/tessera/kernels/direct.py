"""Operators with a kernel of their own: a depthwise convolution (positions on the vector
lanes, or channels on them, ``dwc``), a grouped or flat convolution (positions on the vector
lanes, ``flat``, or output channels on them, ``flatc``), a matrix-vector product (GEMV) and,
where the CPU has AMX-BF16, a GEMM on AMX tiles at float32 accuracy (``amx``).
All are recognised in the IR (the operators ``ops.conv2d`` and ``ops.gemm`` build), so the
tuner offers their ``DirectSchedule`` beside the micro-kernel and loop-nest lowerings and the
model decides between them; the kernels are ``csrc/tessera_depthwise.h``,
``csrc/tessera_dwchan.h``, ``csrc/tessera_flatconv.h``, ``csrc/tessera_gemv.h`` and
``csrc/tessera_gemm_amx.h``, sized at compile time by the defines written here.

Why these: a depthwise convolution has one input channel per output, so the implicit
GEMM has a reduction of only KH x KW and a generic loop nest guards every tap (a grouped one,
a few input channels per group, has the same problem a few times over: the same kernel sums
over the group's channels, ``grouped``); on planes of 7-14 columns its rows leave most of a
vector's lanes idle, so ``dwc`` puts 8 or 16 channels on the lanes instead (oneDNN's blocked
layout), each block's planes transposed into a buffer once a call; the implicit GEMM of any
other convolution packs an im2col block per call, which at stride 2, on small planes and on
groups of 16-32 channels costs as much as the arithmetic (``flat`` reads its B rows straight
from padded phase planes instead; on planes of 7-28 columns, whose rows leave a share of its
vectors' lanes on dropped columns, ``flatc`` puts a group's output channels on the lanes and
broadcasts the positions from the same planes, oneDNN's orientation, with the weight
transposed once a call or once for good, ``Kernel.bind(constant=0)``; ``flatcl`` the same with
tiles of consecutive positions across row ends, for small planes whose rows no register tile
divides); a GEMV reads every
element of its matrix once, so packing it for the micro-kernel (as the GEMM loops do) doubles
the memory traffic of an operator that is nothing but memory traffic; an AMX tile product
(16 x 16 outputs, 32 terms each) runs at 16 times the rate of AVX-512's FMAs, so even the six
bfloat16 products a float32 product takes at float32 accuracy outrun them (``amx``, offered
only where ``amx.amx_ready()``: the CPU has AMX-BF16 and Linux grants the tiles).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.kernels.amx import AMX_FLAGS, amx_ready, amx_source
from tessera.kernels.ir import Access, BinOp, Operator
from tessera.kernels.schedule import ISAS, DirectSchedule


@dataclass(frozen=True)
class ConvSizes:
    """A convolution's sizes as ``ops.conv2d`` builds its operator."""

    n: int
    g: int
    cig: int  # input channels per group
    cog: int  # output channels per group (a depthwise conv's channel multiplier)
    h: int
    w: int
    oh: int
    ow: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int


@dataclass(frozen=True)
class Gemv:
    n: int
    k: int
    trans_b: bool  # B stored [N, K] (a Linear's weight) rather than [K, N]


def conv_of(op: Operator) -> ConvSizes | None:
    """The sizes of ``op`` when it is an ``ops.conv2d`` operator, else None."""
    body = op.body
    if op.name != "conv2d" or not (isinstance(body, BinOp) and isinstance(body.rhs, Access)):
        return None
    x = body.rhs
    n, g, cig, h, w = x.tensor.shape
    _, cog, _, kh, kw = op.inputs[0].shape
    rows, cols = x.index[3], x.index[4]
    _, _, _, oh, ow = op.output.tensor.shape
    return ConvSizes(n=n, g=g, cig=cig, cog=cog, h=h, w=w, oh=oh, ow=ow, kh=kh, kw=kw, sh=rows.coeff("oh") or 1,
                     sw=cols.coeff("ow") or 1, ph=-rows.const, pw=-cols.const)


def depthwise_of(op: Operator) -> ConvSizes | None:
    """The sizes of ``op`` when it is a convolution with one input channel per group."""
    d = conv_of(op)
    return d if d is not None and d.cig == 1 else None


def dwc_of(op: Operator) -> ConvSizes | None:
    """The sizes of ``op`` when the channel-vectorised depthwise kernel (``csrc/tessera_dwchan.h``)
    takes it: one input and one output channel per group."""
    d = conv_of(op)
    return d if d is not None and d.cig == 1 and d.cog == 1 else None


def grouped_of(op: Operator) -> ConvSizes | None:
    """The sizes of ``op`` when it is a grouped convolution (more than one group) with more
    than one input channel per group."""
    d = conv_of(op)
    return d if d is not None and d.g > 1 and d.cig > 1 else None


def flat_of(op: Operator) -> ConvSizes | None:
    """The sizes of ``op`` when the flat direct convolution (``csrc/tessera_flatconv.h``) takes
    it: a convolution with several input channels per group (one group or more), stride 1 or 2."""
    d = conv_of(op)
    return d if d is not None and d.cig > 1 and d.sh in (1, 2) and d.sw in (1, 2) else None


def _phase_rows(d: ConvSizes) -> tuple[int, int]:
    """The phase planes' rows and padded row width (``FC_HQ``, ``FC_WQ`` in ``csrc/tessera_flatconv.h``)."""
    hq = -(-max(d.ph + d.h, (d.oh - 1) * d.sh + d.kh) // d.sh)
    wq = -(-max(d.pw + d.w, (d.ow - 1) * d.sw + d.kw) // d.sw)
    return hq, wq


def flat_positions(d: ConvSizes) -> int:
    """The output positions the flat kernel computes for one image and group: OH rows of WQ
    columns, WQ the phase planes' padded row width."""
    return d.oh * _phase_rows(d)[1]


def flatcl_k_block(d: ConvSizes, nr: int) -> int:
    """The k block of the flatcl kernel (``FC_KCC`` in ``csrc/tessera_flatconv.h``): its weight
    slice ([KC][NR]) and its input channels' phase planes each held to 16 KiB."""
    hq, wq = _phase_rows(d)
    read = (d.oh - 1) * wq + d.ow + ((d.kh - 1) // d.sh) * wq + (d.kw - 1) // d.sw
    channel = d.sh * d.sw * max(hq * wq, read)
    kc_w, kc_x = 4096 // nr, 4096 * d.kh * d.kw // channel // 8 * 8
    fit = max(8, kc_x) if kc_x < kc_w else kc_w
    k = d.cig * d.kh * d.kw
    return k if k <= fit + fit // 2 else fit


def gemv_of(op: Operator) -> Gemv | None:
    """The sizes of ``op`` when it is ``ops.gemm`` with one row (M = 1)."""
    if op.name not in ("gemm_nn", "gemm_nt", "gemm_tn", "gemm_tt"):
        return None
    ext = op.extents
    if ext["m"] != 1:
        return None
    return Gemv(n=ext["n"], k=ext["k"], trans_b=op.name.endswith("t"))


@dataclass(frozen=True)
class AmxGemm:
    m: int
    n: int
    k: int
    trans_b: bool  # B stored [N, K] (a Linear's weight) rather than [K, N]
    batch: int = 1  # products sharing A, each with its own B and C (a 1x1 convolution's images)
    conv: ConvSizes | None = None  # B the images' im2col matrix, gathered (not a 1x1 of stride 1)


def amx_of(op: Operator) -> AmxGemm | None:
    """The sizes of ``op`` as GEMMs when the AMX kernel takes it: ``ops.gemm`` with A stored
    [M, K] (``gemm_nn``, ``gemm_nt``), or a convolution of one group, ``Y = W B`` with A the
    weight [C_out, C_in KH KW]: for a 1x1 of stride 1 and no padding one product an image, B
    the image [C_in, H W] as it lies; for any other one product, B the im2col matrix of all the
    images side by side [C_in KH KW, images OH OW], gathered tile by tile as the kernel splits
    it (``conv``)."""
    if op.name in ("gemm_nn", "gemm_nt"):
        ext = op.extents
        return AmxGemm(m=ext["m"], n=ext["n"], k=ext["k"], trans_b=op.name == "gemm_nt")
    d = conv_of(op)
    if d is None or d.g != 1:
        return None
    if (d.kh, d.kw, d.sh, d.sw, d.ph, d.pw) == (1, 1, 1, 1, 0, 0):
        return AmxGemm(m=d.cog, n=d.h * d.w, k=d.cig, trans_b=False, batch=d.n)
    if d.n * d.cig * d.h * d.w >= 2**31:  # the gather's 32-bit indices reach every input value
        return None
    return AmxGemm(m=d.cog, n=d.n * d.oh * d.ow, k=d.cig * d.kh * d.kw, trans_b=False, conv=d)


def amx_splits_where_used(g: AmxGemm, rows: int) -> bool:
    """Whether the AMX kernel splits B a column pair's slice at a time where it is used (once a
    row block of ``rows``) rather than packing it whole first: where A's rows fit one block, for
    a batch (A split once a call, not once an image) and for a convolution's gathered B. The
    kernel (``GA_FUSED``) and the model both take it from here.

    Not a single GEMM whose B is [K, N] with rows a multiple of 4 KiB apart (N a multiple of
    1024): a column pair's slice then walks K rows that all fall in the same few cache sets, and
    where B lies off a cache line (three lines a row) it ran 17-21% slower than packing B whole
    (128x3072x768: 149 GFLOP/s against 186 on 1 thread, 292 against 352 on 2; 128x1024x1024: 155
    against 196), and no faster on a line (0.97-1.01x); at other N, and on [N, K], the split
    where used ran 1.00-1.08x packing whole over the two placements
    (``benchmarks/probes/amx_split_placement.py``, its output on the Intel VM committed as
    ``benchmarks/results/intel-vm/amx-split-placement.txt``)."""
    if g.conv is not None or g.batch > 1:
        return True
    if not g.trans_b and (4 * g.n) % 4096 == 0:
        return False
    return g.m <= rows


_RECOGNISERS = {"depthwise": depthwise_of, "grouped": grouped_of, "gemv": gemv_of, "flat": flat_of, "flatc": flat_of,
                "flatcl": flat_of, "dwc": dwc_of, "amx": amx_of}


def extra_flags(s) -> tuple[str, ...]:
    """Compiler flags a schedule's kernel needs beyond its ISA's (AMX's for the amx kernel)."""
    return AMX_FLAGS if isinstance(s, DirectSchedule) and s.algo == "amx" else ()


def applies(op: Operator, algo: str) -> bool:
    return _RECOGNISERS[algo](op) is not None


def generate_direct(op: Operator, s: DirectSchedule) -> str:
    """C source of ``op`` under ``s`` (the defines of the kernel's header, then the header)."""
    vec = 512 if s.isa == "avx512" else 256
    if s.algo == "amx":
        g = amx_of(op)
        if g is None:
            raise ValueError(f"{op.name}: the amx kernel takes a GEMM with A stored [M, K] (gemm_nn or gemm_nt) "
                             "or a convolution of one group")
        head = f"/* {op.signature()}\n * schedule: {s.short()} */\n"
        defines = {"GA_M": g.m, "GA_TB": int(g.trans_b), "GA_BATCH": g.batch,
                   "GA_FUSED": int(amx_splits_where_used(g, s.rows))}
        if g.conv is not None:
            c = g.conv
            defines |= {"GA_CONV": 1, "GA_H": c.h, "GA_W": c.w, "GA_KH": c.kh, "GA_KW": c.kw, "GA_SH": c.sh,
                        "GA_SW": c.sw, "GA_PH": c.ph, "GA_PW": c.pw, "GA_OW": c.ow, "GA_P": c.oh * c.ow}
        return head + amx_source(g.n, g.k, s.vecs, s.rows, defines, "tessera_gemm_amx.h")
    if s.algo in ("depthwise", "grouped"):
        d = _RECOGNISERS[s.algo](op)
        if d is None:
            what = "one input channel per group" if s.algo == "depthwise" else "groups of several input channels"
            raise ValueError(f"{op.name}: the {s.algo} kernel takes a conv2d with {what}")
        defines = {"DW_N": d.n, "DW_G": d.g, "DW_COG": d.cog, "DW_CIG": d.cig, "DW_H": d.h, "DW_W": d.w,
                   "DW_OH": d.oh, "DW_OW": d.ow, "DW_KH": d.kh, "DW_KW": d.kw, "DW_SH": d.sh, "DW_SW": d.sw,
                   "DW_PH": d.ph, "DW_PW": d.pw, "DW_RB": s.rows, "DW_U": s.vecs}
        header = "tessera_depthwise.h"
    elif s.algo == "dwc":
        d = dwc_of(op)
        if d is None:
            raise ValueError(f"{op.name}: the dwc kernel takes a conv2d with one input and one output channel a group")
        _check_dwc_block(d, s)
        defines = {"DC_N": d.n, "DC_C": d.g, "DC_H": d.h, "DC_W": d.w, "DC_OH": d.oh, "DC_OW": d.ow, "DC_KH": d.kh,
                   "DC_KW": d.kw, "DC_SH": d.sh, "DC_SW": d.sw, "DC_PH": d.ph, "DC_PW": d.pw, "DC_RB": s.rows}
        header = "tessera_dwchan.h"
    elif s.algo in ("flat", "flatc", "flatcl"):
        d = flat_of(op)
        if d is None:
            raise ValueError(f"{op.name}: the {s.algo} kernel takes a conv2d of several input channels a group, stride 1 or 2")
        if s.algo == "flat" and d.cog % s.rows:
            raise ValueError(f"flat kernel: {s.rows} rows must divide the {d.cog} output channels of a group")
        lanes = s.vecs * (16 if s.isa == "avx512" else 8)
        if s.algo != "flat" and d.cog % lanes:
            raise ValueError(f"{s.algo} kernel: {s.vecs} vectors ({lanes} lanes) must divide the {d.cog} output channels of a group")
        if s.algo == "flatc" and s.rows > d.ow and (s.rows % d.ow or s.rows // d.ow > d.oh):
            raise ValueError(f"flatc kernel: a tile of {s.rows} positions on rows of {d.ow} must be whole rows, "
                             f"at most the {d.oh} the plane has")
        if s.algo == "flatcl" and not flatcl_fits(d, s.rows, lanes):
            raise ValueError(f"flatcl kernel: a plane of {d.oh}x{d.ow} positions must hold a tile of {s.rows} and its "
                             f"sums ({lanes} channels a position) at most {FLATCL_SUMS} floats")
        defines = {"FC_CVEC": int(s.algo != "flat"), "FC_LIN": int(s.algo == "flatcl"), "FC_N": d.n, "FC_G": d.g, "FC_COG": d.cog, "FC_CIG": d.cig, "FC_H": d.h, "FC_W": d.w,
                   "FC_OH": d.oh, "FC_OW": d.ow, "FC_KH": d.kh, "FC_KW": d.kw, "FC_SH": d.sh, "FC_SW": d.sw,
                   "FC_PH": d.ph, "FC_PW": d.pw, "FC_MR": s.rows, "FC_NV": s.vecs}
        header = "tessera_flatconv.h"
    else:
        v = gemv_of(op)
        if v is None:
            raise ValueError(f"{op.name}: the GEMV kernel takes a GEMM with one row (M = 1)")
        defines = {"GV_N": v.n, "GV_K": v.k, "GV_TB": int(v.trans_b), "GV_ROWS": s.rows, "GV_U": s.vecs}
        header = "tessera_gemv.h"
    lines = [f"/* {op.signature()}\n * schedule: {s.short()} */", f"#define TK_VEC {vec}"]
    lines += [f"#define {k} {val}" for k, val in defines.items()]
    lines.append(f'#include "{header}"')
    return "\n".join(lines) + "\n"


def _check_dwc_block(d: ConvSizes, s: DirectSchedule) -> None:
    regs = ISAS[s.isa][1]
    if s.vecs != 1:
        raise ValueError(f"dwc kernel: one vector of channels a position (vecs=1), got vecs={s.vecs}")
    if s.rows > d.ow:
        raise ValueError(f"dwc kernel: a block of {s.rows} positions is wider than the {d.ow} of an output row")
    if s.rows + d.kw + 1 > regs:
        raise ValueError(f"dwc kernel: {s.rows} sums, {d.kw} weights and an input need {s.rows + d.kw + 1} "
                         f"vector registers; {s.isa} has {regs}")


# the register blocks offered per kernel (rows, vecs); the schedule refuses those that do not fit
DEPTHWISE_BLOCKS = tuple((r, u) for r in (1, 2, 3, 4) for u in (1, 2, 4))
# flat: output channels (broadcast) x vectors of output positions; the rows must divide a group's channels
FLAT_BLOCKS = ((4, 3), (4, 4), (4, 6), (8, 1), (8, 2), (8, 3), (16, 1))
# flatc: positions of a row (broadcast) x vectors of output channels; the vectors must divide a group's channels
FLATC_BLOCKS = ((4, 4), (6, 4), (7, 2), (7, 3), (8, 2), (8, 3), (12, 2), (14, 2), (7, 1), (14, 1), (16, 1), (21, 1), (28, 1))
# flatcl: flatc's orientation with tiles of consecutive positions across row ends (small planes,
# whose rows the row tiles of flatc cover with overlap: 7x7 in tiles of 6 computes 54 for 49)
FLATCL_BLOCKS = ((4, 3), (5, 2), (6, 2), (12, 1), (14, 1), (4, 4), (6, 4), (7, 3), (8, 3), (12, 2))
FLATCL_SUMS = 16384  # an item's sums, the whole plane's positions x a block of channels (64 KiB)


def flatcl_fits(d: ConvSizes, rows: int, lanes: int) -> bool:
    return rows <= d.oh * d.ow and d.oh * d.ow * lanes <= FLATCL_SUMS


# dwc: output positions of a row summed together (one vector of channels each)
DWC_BLOCKS = (2, 4, 7, 8, 14)
GEMV_BLOCKS = {False: tuple((r, u) for r in (4, 8) for u in (2, 4, 8)),
               True: tuple((r, u) for r in (2, 4, 6) for u in (1, 2))}


AMX_MIN_ROWS = 16  # below a tile's 16 rows the AVX kernels win: AMX reads 1.5x the weight bytes
# rows of A x columns of K a block: dense.py's probes, and 128 x 1024 (2048^3 on 1 thread at
# 1.0-1.1x 128 x 704 in interleaved probes on the Intel VM: two k blocks, one pass of C fewer)
AMX_BLOCKS = ((256, 768), (256, 384), (128, 768), (128, 1024))
AMX_BATCH_ROWS = 1024  # a batch's A in one row block, up to this many rows


def amx_space(op: Operator, isas: tuple[str, ...]) -> list[DirectSchedule]:
    """The AMX GEMM's blocks, where it applies and runs here: K in near-equal blocks."""
    g = amx_of(op)
    if g is None or g.m < AMX_MIN_ROWS or "avx512" not in isas or amx_ready() is not None:
        return []
    out = []
    blocks = AMX_BLOCKS
    if (g.batch > 1 or g.conv is not None) and g.m > AMX_BLOCKS[0][0]:
        # a batch or a convolution splits (gathers) B's slices once a row block: all of A's rows in
        # one block too, at two depths of K (A's block in L2 or not)
        rows = min(-(-g.m // 32) * 32, AMX_BATCH_ROWS)
        blocks += ((rows, 384), (rows, 768))
    for mb, kc in blocks:
        per_block = -(-g.k // -(-g.k // kc))  # K in as many near-equal blocks as kc would cut
        kc = -(-per_block // 32) * 32
        mb = min(mb, -(-g.m // 32) * 32)
        s = DirectSchedule(algo="amx", isa="avx512", rows=mb, vecs=kc)
        if s not in out:
            out.append(s)
    return out


def direct_space(op: Operator, *, isas: tuple[str, ...]) -> list[DirectSchedule]:
    out = _flat_space(op, isas) + _dwc_space(op, isas) + amx_space(op, isas)
    d, v = depthwise_of(op) or grouped_of(op), gemv_of(op)
    if d is not None:
        blocks, algo = DEPTHWISE_BLOCKS, ("depthwise" if d.cig == 1 else "grouped")
    elif v is not None:
        blocks, algo = GEMV_BLOCKS[v.trans_b], "gemv"
    else:
        return out
    for isa in isas:
        vl = 16 if isa == "avx512" else 8
        for rows, vecs in blocks:
            if d is not None and vecs > 1 and (vecs - 1) * vl >= d.ow:
                continue  # a chunk wider than the row: only padding lanes
            try:
                out.append(DirectSchedule(algo=algo, isa=isa, rows=rows, vecs=vecs))
            except ValueError:
                continue
    return out


def _dwc_space(op: Operator, isas: tuple[str, ...]) -> list[DirectSchedule]:
    d = dwc_of(op)
    if d is None:
        return []
    out = []
    for isa in isas:
        for rows in DWC_BLOCKS:
            s = DirectSchedule(algo="dwc", isa=isa, rows=rows, vecs=1)
            try:
                _check_dwc_block(d, s)
            except ValueError:
                continue
            out.append(s)
    return out


def _flat_space(op: Operator, isas: tuple[str, ...]) -> list[DirectSchedule]:
    d = flat_of(op)
    if d is None:
        return []
    out = []
    for isa in isas:
        vl = 16 if isa == "avx512" else 8
        positions = flat_positions(d)
        for rows, vecs in FLAT_BLOCKS:
            if d.cog % rows or (vecs > 1 and (vecs - 1) * vl >= positions):
                continue  # rows must divide the group's channels; no block of padding lanes only
            try:
                out.append(DirectSchedule(algo="flat", isa=isa, rows=rows, vecs=vecs))
            except ValueError:
                continue
        for rows, vecs in FLATC_BLOCKS:
            if d.cog % (vecs * vl) or (rows > d.ow and (rows % d.ow or rows // d.ow > d.oh)):
                continue  # the vectors divide the group's channels; a tile wider than a row is whole rows
            try:
                out.append(DirectSchedule(algo="flatc", isa=isa, rows=rows, vecs=vecs))
            except ValueError:
                continue
        for rows, vecs in FLATCL_BLOCKS:
            if d.cog % (vecs * vl) or not flatcl_fits(d, rows, vecs * vl):
                continue
            try:
                out.append(DirectSchedule(algo="flatcl", isa=isa, rows=rows, vecs=vecs))
            except ValueError:
                continue
    return out
