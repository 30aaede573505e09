"""The stencil term of the performance model: bytes and flops per point against the measured
machine (``tessera.kernels.machine``: DRAM read and write bandwidth, cache sizes, the FMA
peak that gives the cycle time).

Per sweep of an interior of P points:

    DRAM bytes = P x (4 x coefficient arrays streamed + 4 x field reads + 4 written)
               + grid-level decomposition: P x (split - 1) x (4 field + 8 output) more
    memory time  = reads / (read bandwidth x stream efficiency) + writes / write bandwidth
    compute time = per vector: field loads x FIELD_LOAD_CYCLES + other loads / 2, per thread
                   (field loads: the distinct values of the ``rz`` x ``ry`` jammed rows, per row)
    time = max(memory, compute) + passes x (per-row loop set-up) + the call

Field reads: 1 per point when the planes the tiles touch (tz + 2r whole planes per thread)
fit in the shared L3, else one per plane of the stencil (2r + 1).

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
# a non-temporal store moves the 4 bytes it writes; a plain one (what the machine's write
# bandwidth measures) reads the line first: twice the bus traffic (an estimate, no probe)
NT_WRITE_SPEEDUP = 2.0
CALL_SECONDS = 5e-6


@dataclass(frozen=True)
class Traffic:
    read_bytes: float  # per point, from DRAM
    write_bytes: float  # per point, to DRAM
    loads: float  # per point, vector-lane loads issued
    flops: float  # per point
    streams: int  # concurrent read streams per thread in the widest pass


def roofline_bytes(stencil: Stencil) -> tuple[int, int]:
    """(read, write) bytes per point of the ideal sweep: each coefficient array and the
    field read once, the output written once."""
    return 4 * (len(stencil.arrays) + 1), 4


def _pass_arrays(stencil: Stencil, s: StencilSchedule) -> list[int]:
    pts = stencil.points
    return [len({p.coeff for p in pts[r.start:r.stop] if isinstance(p.coeff, str)})
            for r in split_points(len(pts), s.split)]


def _field_reads(stencil: Stencil, shape, s: StencilSchedule, m: Machine, threads: int) -> float:
    """Field reads from DRAM per point: 1 while the planes the threads' tiles touch (a tile's
    tz planes and r on either side, whole planes since the tiles of a z-block run in y order)
    fit in the shared L3, else one per plane of the stencil (2r + 1)."""
    nz, ny, nx = shape
    r = stencil.radius
    plane = 4.0 * (ny + 2 * stencil.halo) * (nx + 2 * stencil.halo)
    live = (min(s.tz, nz) + 2 * r) * plane * threads
    return 1.0 if live <= 0.75 * m.cache_bytes["L3"] else float(2 * r + 1)


def traffic(stencil: Stencil, shape, s: StencilSchedule, m: Machine, threads: int) -> Traffic:
    arrays = _pass_arrays(stencil, s)
    passes = len(arrays)
    u_reads = _field_reads(stencil, shape, s, m, threads)
    read = 4.0 * sum(arrays) + 4.0 * u_reads
    write = 4.0
    if s.split_level == "grid" and passes > 1:
        read += (passes - 1) * (4.0 * u_reads + 4.0)
        write += (passes - 1) * 4.0
    elif s.split_level == "tile" and passes > 1:
        out_tile = 4.0 * min(s.tz, shape[0]) * min(s.ty, shape[1]) * shape[2]
        if out_tile > 0.75 * m.cache_bytes["L2"]:
            read += (passes - 1) * 4.0
            write += (passes - 1) * 4.0
    widest = max(arrays) if s.split_level != "row" else sum(arrays)
    n = len(stencil.points)
    loads = _field_loads(stencil, shape, s.ry, s.rz) + sum(arrays) + passes  # field, coefficients, the output
    return Traffic(read, write, loads, 2.0 * n, widest + 2)


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
    nz, ny, nx = shape
    points = nz * ny * nx
    t = traffic(stencil, shape, s, m, threads)
    tiles = math.ceil(nz / s.tz) * math.ceil(ny / s.ty)
    busy = math.ceil(tiles / threads) * threads / tiles  # the last round of whole tiles
    run = 4.0 * (min(s.ty, ny) if not s.tx or s.tx >= nx else 1) * min(s.tx or nx, nx)
    read_bw = m.bandwidth("DRAM", threads) * stream_efficiency(t.streams, run)
    write_bw = m.write_bw[min(threads, max(m.write_bw))] * (NT_WRITE_SPEEDUP if s.nt else 1.0)
    t_mem = points * (t.read_bytes / read_bw + t.write_bytes / write_bw)
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
    return CALL_SECONDS + max(t_mem, t_compute) + t_rows


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
