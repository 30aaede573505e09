"""``StencilSchedule``: the stencil compiler's schedule kind, beside the operator compiler's
``GemmSchedule`` and ``LoopSchedule`` (tessera.kernels.schedule).

- spatial blocking: tiles ``tz`` x ``ty`` x ``tx`` of the interior (``tx = 0``: whole rows),
  the tiles (z-blocks x y-blocks) spread over OpenMP threads;
- unroll-and-jam over y and z (register blocking): ``rz`` planes x ``ry`` rows computed in
  one x loop, so a field value they share (an offset's row is another row's neighbour) is
  loaded once and serves several outputs;
- vectorisation along x, the unit-stride axis: an explicit loop of whole vectors (GCC's
  vector extension, every address a constant off one pointer) and the leftover points one
  at a time; off: a plain loop compiled with GCC's tree vectoriser disabled. (The wave
  kernel computes one row at a time.)
- software prefetch (``prefetch`` > 0, vector kernels): each field row the jammed rows read
  is asked for ``prefetch`` floats ahead of the x loop (the rows of a high-order stencil are
  more streams than the hardware prefetchers follow, so without it most new lines are
  demand misses);
- streaming prefetch (``stream`` > 0, vector kernels): only the field rows a block is the
  first to read in the z-major sweep (those of the planes at the stencil's reach ahead; the
  other rows were read for earlier planes and are in cache) asked for ``stream`` floats
  ahead, and the output rows asked for writing, so the read for ownership of an output line
  is under way before its stores: two prefetches a vector of an unjammed row, where
  ``prefetch`` issues one for each row it reads;
- stencil decomposition: ``split`` sub-stencils, consecutive runs of the points holding
  about the same number of coefficient arrays each, applied one after another, each adding
  onto the same output (so each pass streams fewer arrays); ``split_level`` says where the
  passes loop: over the whole grid (``grid``, the paper's form), per tile (``tile``: the
  output tile stays in cache between passes) or per row (``row``);
- factoring (``factor``): the points that share a coefficient (an equal scalar, or one
  array) summed first and multiplied once, as Devito factorises: a 73-point Laplacian has
  10 distinct weights, so 63 of its 73 FMAs become adds, which are off each output's
  chain of dependent FMAs (and on their own pipes on AMD's Zen cores). It changes the
  rounding (a sum of values, then one product), so a factored kernel matches the float32
  reference of its own order (``reference.apply_float32(..., factor=True)``), not the
  unfactored one;
- non-temporal stores (``nt``, single-pass vector kernels of ``apply``): the output's full
  vectors written past the caches, each row's first points up to a vector boundary of its
  output by one masked vector, so a sweep that streams from memory does not read the output's
  lines before writing them (a plain store's read for ownership: 8 bytes of traffic a point
  where 4 are written); jammed rows whose pitch keeps them off that boundary store as before;
- temporal blocking (``time_block`` > 1, the wave kernel only): that many leapfrog steps
  per sweep over z, each step a plane behind the one before by the stencil's radius
  (a wavefront), so a plane is used by all of them while it is in cache.

A schedule never changes results beyond rounding order: the terms of every point are
added in the stencil's order in every schedule, so with FMA contraction off all unfactored
schedules give the same bits (and all factored ones theirs).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from tessera.kernels.schedule import ISAS

SPLIT_LEVELS = ("grid", "tile", "row")


@dataclass(frozen=True, kw_only=True)
class StencilSchedule:
    tz: int = 1
    ty: int = 16
    tx: int = 0  # 0: whole rows
    ry: int = 1  # rows computed together (unroll-and-jam over y)
    rz: int = 1  # planes computed together (unroll-and-jam over z)
    vectorize: bool = True
    split: int = 1
    split_level: str = "tile"
    time_block: int = 1
    prefetch: int = 0  # floats ahead of x each field row is prefetched (0: none)
    stream: int = 0  # floats ahead of x the block's leading field rows and its output rows are prefetched (0: none)
    factor: bool = False  # points sharing a coefficient summed, then multiplied once
    nt: bool = False  # non-temporal stores of the output (single-pass vector sweeps)
    isa: str = "avx2"
    kind: str = field(default="stencil", init=False)

    def __post_init__(self):
        if self.isa not in ISAS:
            raise ValueError(f"unknown vector ISA {self.isa!r}; choose one of {', '.join(ISAS)}")
        for name in ("tz", "ty", "ry", "rz", "split", "time_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch={self.prefetch!r} must be an int >= 0 (floats ahead; 0: none)")
        if self.prefetch and not self.vectorize:
            raise ValueError(f"prefetch={self.prefetch} applies to vector kernels; use vectorize=True or prefetch=0")
        if not isinstance(self.stream, int) or isinstance(self.stream, bool) or self.stream < 0:
            raise ValueError(f"stream={self.stream!r} must be an int >= 0 (floats ahead; 0: none)")
        if self.stream and not self.vectorize:
            raise ValueError(f"stream={self.stream} applies to vector kernels; use vectorize=True or stream=0")
        if not isinstance(self.tx, int) or self.tx < 0:
            raise ValueError(f"tx={self.tx!r} must be an int >= 0 (0: whole rows)")
        if not isinstance(self.factor, bool):
            raise ValueError(f"factor={self.factor!r} must be True or False")
        if self.factor and self.split > 1:
            raise ValueError(f"factor=True with split={self.split}: factoring applies to undecomposed sweeps; "
                             "use split=1 or factor=False")
        if not isinstance(self.nt, bool):
            raise ValueError(f"nt={self.nt!r} must be True or False")
        if self.nt and (not self.vectorize or self.split > 1):
            raise ValueError(f"nt=True applies to single-pass vector sweeps (vectorize=True, split=1), got "
                             f"vectorize={self.vectorize}, split={self.split}")
        if self.split_level not in SPLIT_LEVELS:
            raise ValueError(f"split_level {self.split_level!r}; choose one of {', '.join(SPLIT_LEVELS)}")

    @property
    def decomposed(self) -> bool:
        return self.split > 1

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def short(self) -> str:
        split = f" split{self.split}@{self.split_level}" if self.split > 1 else ""
        tb = f" T{self.time_block}" if self.time_block > 1 else ""
        jam = (f" rz{self.rz}" if self.rz > 1 else "") + (f" ry{self.ry}" if self.ry > 1 else "")
        pf = (f" pf{self.prefetch}" if self.prefetch else "") + (f" st{self.stream}" if self.stream else "")
        fac = (" factored" if self.factor else "") + (" nt" if self.nt else "")
        return (f"{self.isa} tile{self.tz}x{self.ty}x{self.tx or 'row'}{jam} simd{int(self.vectorize)}{pf}{fac}"
                f"{split}{tb}")

    @staticmethod
    def from_dict(data: dict) -> StencilSchedule:
        data = {k: v for k, v in data.items() if k != "kind"}
        return StencilSchedule(**data)


def split_points(n_points: int, split: int) -> list[range]:
    """Cut the points 0..n-1 into ``split`` consecutive runs of nearly equal length (with one
    array per offset, about as many coefficient arrays each). Runs stay in order, so the
    summation order of every point is unchanged."""
    split = max(1, min(split, n_points))
    bounds = [n_points * i // split for i in range(split + 1)]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
