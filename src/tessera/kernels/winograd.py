"""Winograd convolution for 3x3, stride-1 convolutions (groups 1): F(2x2, 3x3) and
F(4x4, 3x3), which do 2.25x and 4x fewer multiplications than the direct sum at the price of
transforms and a larger rounding error (bounded in the tests against float64). The
transforms are ``csrc/tessera_winograd.h``; the (m+2)^2 GEMMs in between are Tessera's own
GEMM kernel, whose schedule the model picks when the Winograd candidates are ranked.
"""

from __future__ import annotations

from tessera.kernels import ops
from tessera.kernels.direct import ConvSizes, conv_of
from tessera.kernels.ir import Operator
from tessera.kernels.machine import Machine
from tessera.kernels.schedule import WINOGRAD_TILES, GemmSchedule, WinogradSchedule

# non-zero terms of each transform's rows, summed (the FMAs one tile column takes)
NONZEROS = {2: {"bt": 8, "at": 6}, 4: {"bt": 20, "at": 16}}


def winograd_of(op: Operator) -> ConvSizes | None:
    """The sizes of ``op`` when it is a 3x3 stride-1 convolution Winograd can run."""
    d = conv_of(op)
    if d is None or d.g != 1 or (d.kh, d.kw, d.sh, d.sw) != (3, 3, 1, 1):
        return None
    return d


def tiles(d: ConvSizes, m: int) -> int:
    return d.n * -(-d.oh // m) * -(-d.ow // m)


def gemm_op(op: Operator, m: int) -> Operator:
    """The (m+2)^2 GEMMs in the middle: M[xi] (K x T) = U[xi] (K x C) V[xi] (C x T)."""
    d = winograd_of(op)
    return ops.batched_gemm((m + 2) ** 2, d.cog, tiles(d, m), d.cig)


def applies(op: Operator, m: int) -> bool:
    d = winograd_of(op)  # the GEMM needs K, C and the tile count >= 2 (else its M or N axis vanishes)
    return d is not None and min(d.cog, d.cig, tiles(d, m)) >= 2


def generate_winograd(op: Operator, s: WinogradSchedule) -> str:
    d = winograd_of(op)
    if d is None:
        raise ValueError(f"{op.name}: Winograd takes a 3x3 convolution of stride 1 and one group")
    defines = {"WG_M": s.m, "WG_N": d.n, "WG_C": d.cig, "WG_K": d.cog, "WG_H": d.h, "WG_W": d.w, "WG_PH": d.ph,
               "WG_PW": d.pw, "WG_OH": d.oh, "WG_OW": d.ow}
    # the GEMM schedule is named in the source: each schedule gets a library (and a GEMM pointer) of its own
    lines = [f"/* {op.signature()}\n * schedule: {s.short()} */", f"#define TK_VEC {512 if s.isa == 'avx512' else 256}"]
    lines += [f"#define {k} {v}" for k, v in defines.items()]
    lines.append('#include "tessera_winograd.h"')
    return "\n".join(lines) + "\n"


def predict_transforms(op: Operator, s: WinogradSchedule, m: Machine, threads: int) -> float:
    """The transforms' seconds (the GEMM's are the GEMM model's): their vector loads, FMAs and
    stores at two a cycle, the weights' transform, and the scratch they write."""
    from tessera.kernels.model import CALL_SECONDS, _balance, _cycle

    d = winograd_of(op)
    a, vl = s.m + 2, 16 if s.isa == "avx512" else 8
    th, tw = -(-d.oh // s.m), -(-d.ow // s.m)
    twv = -(-tw // vl) * vl
    nz = NONZEROS[s.m]
    t = tiles(d, s.m)
    # weights: per output channel and VL input channels, the 9 VL-wide filter gather (scalar
    # moves, two a cycle), then (3 + a) vector transforms of up to 3a FMAs (two a cycle)
    weights = d.cog * -(-d.cig // vl) * (9 * vl / 2 + (3 + a) * 3 * a / 2)
    stage1 = s.m * (twv + vl) / vl * (2 * a + nz["bt"])
    stage2 = twv / vl * a * (2 * a + nz["bt"])
    fill = 2.0 / vl if (s.m == 2 and vl == 16) else 1.5  # the plane's phase split: vector (F2, AVX-512) or scalar
    inputs = d.n * d.cig * (fill * d.h * d.w + th * (stage1 + stage2) / 2)
    outputs = d.n * d.cog * (th * twv / vl * (a * (a + nz["at"] + s.m) + s.m * (a + nz["at"] + s.m)) / 2
                             + d.oh * d.ow)
    t_eff = max(1, threads)
    cycles = weights / _balance(d.cog, t_eff) + (inputs + outputs) / _balance(d.n * min(d.cig, d.cog), t_eff)
    scratch = 4.0 * a * a * (d.cog * d.cig + d.cig * t + d.cog * t)  # U, V and M written once
    return 3 * CALL_SECONDS + cycles * _cycle(m, s.isa) + scratch / m.write_bw[min(m.write_bw, key=lambda k: abs(k - t_eff))]


def predict_winograd(op: Operator, s: WinogradSchedule, m: Machine, threads: int) -> float:
    from tessera.kernels.model import predict_gemm

    return predict_transforms(op, s, m, threads) + predict_gemm(gemm_op(op, s.m), s.gemm, m, threads)


def winograd_space(op: Operator, *, threads: int, isas: tuple[str, ...], machine: Machine) -> list[WinogradSchedule]:
    """F(2x2) and F(4x4) in each ISA, each with the model's best GEMM schedule for its GEMMs."""
    from tessera.kernels.model import predict_gemm
    from tessera.kernels.space import gemm_space

    out = []
    for tile in WINOGRAD_TILES:
        if not applies(op, tile):
            continue
        g = gemm_op(op, tile)
        candidates: list[GemmSchedule] = gemm_space(g, threads=threads, isas=isas)
        if not candidates:
            continue
        best = min(candidates, key=lambda s: predict_gemm(g, s, machine, threads))
        out += [WinogradSchedule(m=tile, isa=isa, gemm=best) for isa in isas]
    return out
