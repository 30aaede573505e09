"""Stencil -> C under a ``StencilSchedule``: the stencil compiler's own generator, with the
operator compiler's calling convention (``tk_init``; ``tk_run(out, in..., nthreads)``, here
the coefficient arrays as one array of pointers) and its build path (``kernels.compiler``).

Every offset is a compile-time constant added to a row pointer, so the body has no index
arithmetic and no bounds guards (the halo holds every read). Coefficients are hexadecimal
float literals (exact) or one load each from their array. Each point's terms are added one
by one in the stencil's order onto ``acc``, which starts at 0 (first pass) or at the output
(later passes of a decomposed stencil); nothing is reassociated, so with
``-ffp-contract=off`` every schedule gives the float32 reference's bits.
"""

from __future__ import annotations

import numpy as np

from tessera.stencil.schedule import StencilSchedule, split_points
from tessera.stencil.stencil import Stencil

HELPERS = "static inline long tk_min(long a, long b) { return a < b ? a : b; }\n"
NOVEC = '__attribute__((optimize("no-tree-vectorize"))) '


def _literal(value: float) -> str:
    return float(np.float32(value)).hex() + "f"


class _Layout:
    def __init__(self, stencil: Stencil, shape: tuple[int, int, int]):
        self.stencil, self.shape, self.h = stencil, shape, stencil.halo
        nz, ny, nx = shape
        self.py, self.px = ny + 2 * self.h, nx + 2 * self.h
        self.index = {name: i for i, name in enumerate(stencil.arrays)}

    def offset(self, off) -> int:
        dz, dy, dx = off
        return (dz * self.py + dy) * self.px + dx

    def term(self, p, row: int = 0, acc: str = "acc") -> str:
        """``acc += c * u`` of point ``p`` for the ``row``-th of the rows jammed together."""
        nx = self.shape[2]
        if isinstance(p.coeff, str):
            coeff = f"c{self.index[p.coeff]}[ci + {row * nx} + x]"
        else:
            coeff = _literal(p.coeff)
        return f"{acc} = {acc} + {coeff} * v[x + ({self.offset(p.offset) + row * self.px})];"

    def decls(self) -> str:
        return "\n".join(f"  const float *restrict c{i} = coefs[{i}];" for i in range(len(self.index)))

    def row_ptrs(self, out: str = "out", src: str = "u") -> str:
        nz, ny, nx = self.shape
        h = self.h
        return (f"float *restrict o = {out} + ((z + {h}) * {self.py} + (y + {h})) * {self.px} + {h};\n"
                f"const float *restrict v = {src} + ((z + {h}) * {self.py} + (y + {h})) * {self.px} + {h};\n"
                f"const long ci = (z * {ny} + y) * {nx}; (void)ci;")


def _x_loop(lay: _Layout, points, first: bool, s: StencilSchedule, lo: str, hi: str, init: str | None = None,
            rows: int = 1) -> str:
    """The x loop over ``rows`` consecutive rows at once (unroll-and-jam over y: a field value
    the rows share is loaded once); each row's terms are still added in point order."""
    pragma = "#pragma omp simd\n" if s.vectorize else ""
    px = lay.px
    starts = [init if init is not None else ("0.0f" if first else f"o[x + {j * px}]") for j in range(rows)]
    decl = " ".join(f"float acc{j} = {st};" for j, st in enumerate(starts))
    body = "\n    ".join(lay.term(p, j, f"acc{j}") for p in points for j in range(rows))
    store = " ".join(f"o[x + {j * px}] = acc{j};" for j in range(rows))
    return f"{pragma}for (long x = {lo}; x < {hi}; ++x) {{\n    {decl}\n    {body}\n    {store}\n}}"


def _passes(stencil: Stencil, s: StencilSchedule) -> list[tuple]:
    return [stencil.points[r.start:r.stop] for r in split_points(len(stencil.points), s.split)]


def _nest(lay: _Layout, s: StencilSchedule, groups) -> str:
    """The z, y, x-block loops of one tile; ``groups``: (points, first pass?) x loops in each
    row. Rows go ``s.ry`` at a time, the tile's remaining rows one at a time."""
    nx = lay.shape[2]
    tx = s.tx or nx

    def rows(n: int, step: str) -> str:
        loops = "\n".join(_x_loop(lay, g, first, s, "bx", "x1", rows=n) for g, first in groups)
        return (f"for (; {step}; y += {n})\n"
                f"for (long bx = 0; bx < {nx}; bx += {tx}) {{\nconst long x1 = tk_min(bx + {tx}, {nx});\n"
                f"{lay.row_ptrs()}\n{loops}\n}}")

    jammed = rows(s.ry, f"y + {s.ry} <= y1") + "\n" if s.ry > 1 else ""
    return f"for (long z = bz; z < z1; ++z) {{\nlong y = by;\n{jammed}{rows(1, 'y < y1')}\n}}"


def _tiles(lay: _Layout, s: StencilSchedule, inner: str) -> str:
    nz, ny, _ = lay.shape
    return (f"#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)\n"
            f"for (long bz = 0; bz < {nz}; bz += {s.tz})\nfor (long by = 0; by < {ny}; by += {s.ty}) {{\n"
            f"const long z1 = tk_min(bz + {s.tz}, {nz}), y1 = tk_min(by + {s.ty}, {ny});\n{inner}\n}}")


def generate_apply(stencil: Stencil, shape: tuple[int, int, int], s: StencilSchedule) -> str:
    """C for out = stencil(u) over the interior; the sub-stencils of a decomposition loop
    per row, per tile or over the whole grid, as ``split_level`` says."""
    lay = _Layout(stencil, shape)
    groups = [(g, i == 0) for i, g in enumerate(_passes(stencil, s))]
    if s.split_level == "row" or len(groups) == 1:
        nests = _tiles(lay, s, _nest(lay, s, groups))
    elif s.split_level == "tile":
        nests = _tiles(lay, s, "\n".join(_nest(lay, s, [g]) for g in groups))
    else:  # grid: one parallel sweep per sub-stencil
        nests = "\n".join(_tiles(lay, s, _nest(lay, s, [g])) for g in groups)
    attr = "" if s.vectorize else NOVEC
    return "\n".join([
        f"/* stencil {stencil.signature()} grid {shape}\n * schedule: {s.short()} */", HELPERS,
        "void tk_init(void) {}",
        f"{attr}void tk_run(float *restrict out, const float *restrict u, const float *const *coefs, int nthreads) {{",
        "  (void)coefs; (void)nthreads;", lay.decls(), nests, "}",
    ]) + "\n"


def generate_wave(stencil: Stencil, shape: tuple[int, int, int], s: StencilSchedule) -> str:
    """C for ``steps`` leapfrog steps, next = 2 cur - prev + stencil(cur) (+ the source), in
    place: ``a`` holds u(n-1) and ``b`` u(n); step k writes into the buffer of u(n-1+k).
    ``time_block`` steps share one sweep over z, step k at plane p - k r (r the radius):
    step k+1 at plane z needs step k's planes up to z + r, and overwrites a plane step k
    has finished reading, so one barrier per plane step keeps it exact."""
    lay = _Layout(stencil, shape)
    nz, ny, nx = shape
    r, tb = max(1, stencil.radius), s.time_block
    x_loop = _x_loop(lay, stencil.points, False, s, "0", str(nx), init="2.0f * v[x] - o[x]")
    attr = "" if s.vectorize else NOVEC
    body = f"""
  for (long t0 = 0; t0 < steps; t0 += {tb}) {{
    const long nt = tk_min({tb}, steps - t0);
    #pragma omp parallel num_threads(nthreads)
    for (long p = 0; p < {nz} + (nt - 1) * {r}; ++p) {{
      for (long k = 0; k < nt; ++k) {{
        const long z = p - k * {r};
        if (z < 0 || z >= {nz}) continue;
        const long t = t0 + k;
        float *restrict dst = (t % 2 == 0) ? a : b;
        const float *restrict cur = (t % 2 == 0) ? b : a;
        #pragma omp for schedule(static)
        for (long y = 0; y < {ny}; ++y) {{
          {lay.row_ptrs("dst", "cur")}
          {x_loop}
          if (z == sz && y == sy) o[sx] += src[t];
        }}
      }}
    }}
  }}"""
    return "\n".join([
        f"/* wave {stencil.signature()} grid {shape}\n * schedule: {s.short()} */", HELPERS,
        "void tk_init(void) {}",
        f"{attr}void tk_wave(float *restrict a, float *restrict b, const float *const *coefs, const float *restrict src,"
        " long sz, long sy, long sx, long steps, int nthreads) {",
        "  (void)coefs;", lay.decls(), body, "}",
    ]) + "\n"
