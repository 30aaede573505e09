"""The stencil term of the performance model: bytes and flops per point against the measured
machine (``tessera.kernels.machine``: DRAM read and write bandwidth, cache sizes, the FMA
peak that gives the cycle time).

Per sweep of an interior of P points:

    DRAM bytes = P x (4 x coefficient arrays streamed + 4 (the field, once) + 4 written)
               + grid-level decomposition: P x (split - 1) x (4 field + 8 output) more
    re-read bytes = P x 4 x (field reads - 1) (x passes at grid level)
    memory time  = reads / (read bandwidth x stream efficiency) + re-reads / their level's
                   bandwidth + writes / write bandwidth
    compute time = per vector: field loads x FIELD_LOAD_CYCLES + other loads / 2, per thread
                   (field loads: the distinct values of the ``rz`` x ``ry`` jammed rows, per row)
    time = max(memory, compute) + passes x (per-row loop set-up) + the call

Field reads from beyond L2, per point, from the tile's geometry (r the radius; the tiles of a
thread run z-block by z-block, y-tiles inner; inside a tile ``rz`` planes at a time, rows inner):
(tz + 2r) / tz while a whole tile's field (tz + 2r planes x ty + 2r rows) stays in L2 with the
coefficient and output rows streamed through it meanwhile (the next y-tile finds its overlap
there); x (ty + 2r) / ty while only the window of one z step (rz + 2r planes x ty + 2r rows)
does (a deep tile streaming through z reads each plane's rows once); (rz + 2r) / rz x
(ty + 2r) / ty when not even that fits. The first read comes from DRAM; the re-reads from
L3 at its measured bandwidth while the planes the threads touch fit there, else from DRAM.
(On a VM whose L3 runs at DRAM speed, re-reads are what keeps a constant-coefficient
stencil in shallow tiles off its roofline.)

Stream efficiency: a sweep reading S arrays at once keeps S read streams in flight per
thread; past the hardware prefetcher's streams (``PREFETCH_STREAMS``) the prefetcher loses
some and DRAM pages thrash. ``(PREFETCH_STREAMS / S) ** STREAM_EXPONENT`` is an estimate
(two constants, not measured by the machine benchmark), and it is what makes decomposition
(fewer arrays per pass, more passes over the output) a choice the model can weigh. Each
stream is read in runs of a tile's rows (ty x row bytes, contiguous); a run's first
``RAMP_BYTES`` come before the prefetcher is ahead, so taller tiles stream better.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.kernels.machine import Machine
from tessera.stencil.schedule import StencilSchedule, split_points
from tessera.stencil.stencil import Stencil

PREFETCH_STREAMS = 16
STREAM_EXPONENT = 0.35
RAMP_BYTES = 2048  # bytes of a run before the prefetcher is ahead of it (an estimate)
LOADS_PER_CYCLE = 2
# Cycles per vector of one field term (an unaligned load, often split across cache lines,
# from one of up to 37 rows in flight, and its FMA): fitted to the constant-coefficient
# rows of the first full `tessera bench stencil` run on this VM (star25, ete37, ete73 at
# 256^3: 2.6-4.1 cycles with AVX2, 5 with AVX-512, whose 512-bit loads run as two halves
# here). Coefficient and output loads are aligned streams: LOADS_PER_CYCLE.
FIELD_LOAD_CYCLES = {"avx2": 3.0, "avx512": 5.0}
ROW_CYCLES = 30  # a row's loop set-up and pointer arithmetic, per pass
CALL_SECONDS = 5e-6


@dataclass(frozen=True)
class Traffic:
    read_bytes: float  # per point, from DRAM
    write_bytes: float  # per point, to DRAM
    loads: float  # per point, vector-lane loads issued
    flops: float  # per point
    streams: int  # concurrent read streams per thread in the widest pass
    reread_bytes: float = 0.0  # per point, the field's re-reads from beyond L2 (L3 or DRAM: ``reread_level``)
    reread_level: str = "L3"


def roofline_bytes(stencil: Stencil) -> tuple[int, int]:
    """(read, write) bytes per point of the ideal sweep: each coefficient array and the
    field read once, the output written once."""
    return 4 * (len(stencil.arrays) + 1), 4


def _pass_arrays(stencil: Stencil, s: StencilSchedule) -> list[int]:
    pts = stencil.points
    return [len({p.coeff for p in pts[r.start:r.stop] if isinstance(p.coeff, str)})
            for r in split_points(len(pts), s.split)]


def field_reads(stencil: Stencil, shape, s: StencilSchedule, m: Machine, arrays: int = 0) -> float:
    """Reads of each field value from beyond L2 per sweep (>= 1), from the tile's geometry;
    ``arrays``: coefficient arrays streamed through L2 beside it (with the output)."""
    nz, ny, nx = shape
    r = stencil.radius
    tz, ty = min(s.tz, nz), min(s.ty, ny)
    rz = min(s.rz, tz)
    row = 4.0 * (nx + 2 * stencil.halo)
    streamed = 4.0 * (arrays + 1) * nx  # coefficient and output bytes of one output row
    room = 0.75 * m.cache_bytes["L2"]
    if (tz + 2 * r) * (ty + 2 * r) * row + tz * ty * streamed <= room:
        return (tz + 2 * r) / tz
    y_halo = (ty + 2 * r) / ty
    if (rz + 2 * r) * (ty + 2 * r) * row + rz * ty * streamed <= room:
        return (tz + 2 * r) / tz * y_halo
    return (rz + 2 * r) / rz * y_halo


def _in_l3(stencil: Stencil, shape, s: StencilSchedule, m: Machine, threads: int) -> bool:
    """Whether the planes the threads' tiles touch (tz + 2r whole planes each) fit in the shared L3."""
    nz, ny, nx = shape
    plane = 4.0 * (ny + 2 * stencil.halo) * (nx + 2 * stencil.halo)
    return (min(s.tz, nz) + 2 * stencil.radius) * plane * threads <= 0.75 * m.cache_bytes["L3"]


def traffic(stencil: Stencil, shape, s: StencilSchedule, m: Machine, threads: int) -> Traffic:
    arrays = _pass_arrays(stencil, s)
    passes = len(arrays)
    widest = max(arrays) if s.split_level != "row" else sum(arrays)
    reads = field_reads(stencil, shape, s, m, widest)
    read = 4.0 * sum(arrays) + 4.0
    reread = 4.0 * (reads - 1.0)
    write = 4.0
    if s.split_level == "grid" and passes > 1:
        read += (passes - 1) * 8.0  # each later pass reads the field and the output again
        reread *= passes
        write += (passes - 1) * 4.0
    elif s.split_level == "tile" and passes > 1:
        out_tile = 4.0 * min(s.tz, shape[0]) * min(s.ty, shape[1]) * shape[2]
        if out_tile > 0.75 * m.cache_bytes["L2"]:
            read += (passes - 1) * 4.0
            write += (passes - 1) * 4.0
    n = len(stencil.points)
    loads = _field_loads(stencil, shape, s.ry, s.rz) + sum(arrays) + passes  # field, coefficients, the output
    level = "L3" if _in_l3(stencil, shape, s, m, threads) else "DRAM"
    return Traffic(read, write, loads, 2.0 * n, widest + 2, reread, level)


def _field_loads(stencil: Stencil, shape, ry: int, rz: int = 1) -> float:
    """Distinct field values an x iteration loads per row when ``rz`` planes x ``ry`` rows
    are jammed."""
    offsets = {p.offset for p in stencil.points}
    block = {(dz + k, dy + j, dx) for dz, dy, dx in offsets for k in range(rz) for j in range(ry)}
    return len(block) / (ry * rz)


def stream_efficiency(streams: int, run_bytes: float) -> float:
    """Read bandwidth kept with ``streams`` streams per thread, each read in contiguous runs
    of ``run_bytes`` (a tile's rows of one plane) that the prefetcher must ramp up on."""
    return min(1.0, (PREFETCH_STREAMS / streams) ** STREAM_EXPONENT) * run_bytes / (run_bytes + RAMP_BYTES)


def predict_stencil(stencil: Stencil, shape, s: StencilSchedule, m: Machine, threads: int = 1) -> float:
    """Predicted seconds of one sweep over an interior of ``shape``."""
    t_mem, t_compute, t_rows = predict_parts(stencil, shape, s, m, threads)
    return CALL_SECONDS + max(t_mem, t_compute) + t_rows


def predict_parts(stencil: Stencil, shape, s: StencilSchedule, m: Machine, threads: int = 1
                  ) -> tuple[float, float, float]:
    """(memory, compute, row set-up) seconds of one sweep: ``predict_stencil`` takes the
    longer of the first two; the tuner breaks the model's ties on them (a schedule bound
    by compute still does better moving fewer bytes, and the reverse)."""
    nz, ny, nx = shape
    points = nz * ny * nx
    t = traffic(stencil, shape, s, m, threads)
    tiles = math.ceil(nz / s.tz) * math.ceil(ny / s.ty)
    busy = math.ceil(tiles / threads) * threads / tiles  # the static schedule's last round
    run = 4.0 * (min(s.ty, ny) if not s.tx or s.tx >= nx else 1) * min(s.tx or nx, nx)
    read_bw = m.bandwidth("DRAM", threads) * stream_efficiency(t.streams, run)
    reread_bw = read_bw if t.reread_level == "DRAM" else m.bandwidth("L3", threads)
    t_mem = points * (t.read_bytes / read_bw + t.reread_bytes / reread_bw
                      + t.write_bytes / m.write_bw[min(threads, max(m.write_bw))])
    isa_vl = 16 if s.isa == "avx512" else 8
    vl = isa_vl if s.vectorize else 1
    cycle = 2 * isa_vl * 2 / m.peak(1, s.isa)  # 2 FMA pipes of the ISA's lanes, 2 flops each
    tx = s.tx or nx
    fill = tx / (math.ceil(tx / vl) * vl)
    passes = len(_pass_arrays(stencil, s))
    field = _field_loads(stencil, shape, s.ry, s.rz)
    per_vector = field * FIELD_LOAD_CYCLES[s.isa] + (t.loads - field) / LOADS_PER_CYCLE
    t_compute = points * per_vector / (vl * fill) * cycle * busy / threads
    t_rows = nz * ny * math.ceil(nx / tx) * passes * ROW_CYCLES * cycle / threads
    return t_mem, t_compute, t_rows


def incore_seconds(stencil: Stencil, shape, s: StencilSchedule, m: Machine, threads: int = 1) -> float:
    """The in-core bound of one sweep under ``s``: per vector of outputs, its FMAs (one a
    point of the stencil) and its loads (the distinct field values of the jammed rows,
    per row, plus each coefficient array and the output once) at the core's peak of two of
    each a cycle; the threads' cores in parallel. No schedule of that register blocking can
    beat it; ``roofline_seconds`` is the DRAM bound."""
    points = math.prod(shape)
    isa_vl = 16 if s.isa == "avx512" else 8
    cycle = 2 * isa_vl * 2 / m.peak(1, s.isa)
    fmas = len(stencil.points)
    loads = _field_loads(stencil, shape, s.ry, s.rz) + len(stencil.arrays) + 1
    return points / isa_vl * max(fmas, loads) / 2 * cycle / threads


def roofline_seconds(stencil: Stencil, shape, m: Machine, threads: int) -> float:
    """The memory roofline of one sweep: the ideal bytes over the measured DRAM bandwidths."""
    read, write = roofline_bytes(stencil)
    points = math.prod(shape)
    return points * (read / m.bandwidth("DRAM", threads) + write / m.write_bw[min(threads, max(m.write_bw))])
