"""Stencil -> C under a ``StencilSchedule``: the stencil compiler's own generator, with the
operator compiler's calling convention (``tk_init``; ``tk_run(out, in..., nthreads)``, here
the coefficient arrays as one array of pointers) and its build path (``kernels.compiler``).

Every offset is a compile-time constant added to a row pointer, so the body has no index
arithmetic and no bounds guards (the halo holds every read). Where a stencil's offsets come
in ascending address order (the shipped shapes' order), the vector body walks the field
values in that order: each value is loaded once and added to every jammed row that reads it
(kept in a register by an empty asm, which GCC would otherwise undo by folding the load into
each FMA again), and each row's terms still come in the stencil's order. Coefficients are hexadecimal
float literals (exact) or one load each from their array. Each point's terms are added one
by one in the stencil's order onto ``acc``, which starts at 0 (first pass) or at the output
(later passes of a decomposed stencil); nothing is reassociated, so with
``-ffp-contract=off`` every schedule gives the float32 reference's bits.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from tessera.kernels.schedule import ISAS
from tessera.stencil.schedule import StencilSchedule, split_points
from tessera.stencil.stencil import Stencil, factor_groups

HELPERS = "static inline long tk_min(long a, long b) { return a < b ? a : b; }\n"
NOVEC = '__attribute__((optimize("no-tree-vectorize"))) '
# the explicit loop's vectors: ``vf`` in registers, ``vfu`` its unaligned view for loads and stores
VECTOR_TYPES = """#include <immintrin.h>
typedef float vf __attribute__((vector_size({bytes})));
typedef float vfu __attribute__((vector_size({bytes}), aligned(4)));
#define LD(p) (*(const vfu *)(p))
#define ST(p, a) (*(vfu *)(p) = (a))
{masked}
#define STNT(p, a) {stream}((p), ({vtype})(a))"""
# a row's last points (fewer than a vector) as one masked vector: masked-off lanes are neither
# read (no fault past an array's end) nor written
MASKED = {
    "avx512": """#define TK_TAIL_MASK(n) const __mmask16 tk_m = (__mmask16)((1u << (n)) - 1u)
#define LDM(p) ((vf)_mm512_maskz_loadu_ps(tk_m, (p)))
#define STM(p, a) _mm512_mask_storeu_ps((p), tk_m, (__m512)(a))""",
    "avx2": """#define TK_TAIL_MASK(n) const __m256i tk_m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n)), \\
    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define LDM(p) ((vf)_mm256_maskload_ps((p), tk_m))
#define STM(p, a) _mm256_maskstore_ps((p), tk_m, (__m256)(a))""",
}


def _vector_types(isa: str) -> str:
    wide = isa == "avx512"
    return VECTOR_TYPES.format(bytes=4 * ISAS[isa][0], masked=MASKED[isa], stream="_mm512_stream_ps" if wide
                               else "_mm256_stream_ps", vtype="__m512" if wide else "__m256")


def _literal(value: float) -> str:
    return float(np.float32(value)).hex() + "f"


class _Layout:
    def __init__(self, stencil: Stencil, shape: tuple[int, int, int]):
        self.stencil, self.shape, self.h = stencil, shape, stencil.halo
        nz, ny, nx = shape
        self.py, self.px = ny + 2 * self.h, nx + 2 * self.h
        self.index = {name: i for i, name in enumerate(stencil.arrays)}
        # the distinct scalar coefficients, each a vector constant of the explicit loop
        self.constants = {c: f"K{i}" for i, c in enumerate(dict.fromkeys(
            _literal(p.coeff) for p in stencil.points if not isinstance(p.coeff, str)))}

    def offset(self, off) -> int:
        dz, dy, dx = off
        return (dz * self.py + dy) * self.px + dx

    def field_row(self, row: tuple[int, int]) -> int:
        """Offset of jammed row (plane k, row j) from the block's first row, in the field and output."""
        k, j = row
        return (k * self.py + j) * self.px

    def coeff_row(self, row: tuple[int, int]) -> int:
        """The same in a coefficient array (interior shape, no halo)."""
        k, j = row
        _, ny, nx = self.shape
        return (k * ny + j) * nx

    def term(self, p, row: tuple[int, int] = (0, 0), acc: str = "acc", vector: bool = False,
             value: str | None = None, ld: str = "LD") -> str:
        """``acc += c * u`` of point ``p`` for jammed row ``row``; ``vector``: one vector of
        the explicit loop (``q`` points at the field's x, every address a constant off it),
        its loads through the macro ``ld`` (``LDM``: masked); ``value``: the field value
        already loaded (a variable's name) instead of a load of its own."""
        field = self.offset(p.offset) + self.field_row(row)
        if isinstance(p.coeff, str):
            arr, at = f"c{self.index[p.coeff]}", f"ci + {self.coeff_row(row)} + x"
            coeff = f"{ld}({arr} + {at})" if vector else f"{arr}[{at}]"
        else:
            coeff = self.constants[_literal(p.coeff)] if vector else _literal(p.coeff)
        if value is None:
            value = f"{ld}(q + {field})" if vector else f"v[x + ({field})]"
        return f"{acc} = {acc} + {coeff} * {value};"

    def decls(self, vector: bool = False) -> str:
        arrays = [f"  const float *restrict c{i} = coefs[{i}];" for i in range(len(self.index))]
        consts = [f"  const vf {name} = (vf){{}} + {lit};" for lit, name in self.constants.items()] if vector else []
        return "\n".join(arrays + consts)

    def row_ptrs(self, out: str = "out", src: str = "u") -> str:
        nz, ny, nx = self.shape
        h = self.h
        return (f"float *restrict o = {out} + ((z + {h}) * {self.py} + (y + {h})) * {self.px} + {h};\n"
                f"const float *restrict v = {src} + ((z + {h}) * {self.py} + (y + {h})) * {self.px} + {h};\n"
                f"const long ci = (z * {ny} + y) * {nx}; (void)ci;")


def _rows(rz: int, ry: int) -> list[tuple[int, int]]:
    return [(k, j) for k in range(rz) for j in range(ry)]


def _x_loop(lay: _Layout, points, first: bool, s: StencilSchedule, lo: str, hi: str,
            block: list[tuple[int, int]], init: tuple[str, str] | None = None) -> str:
    """The x loop over the jammed rows ``block`` (plane, row). With ``s.vectorize``, whole
    vectors of the ISA's width first, in GCC's vector extension: every field address is a
    constant off one pointer ``q``, so the compiler keeps one induction variable and folds
    each offset into its load, and a value the rows share is one address, loaded once.
    Then the row's last points, fewer than a vector, as one masked vector (the same body,
    its loads and stores masked). Where every load is from the field (constant coefficients)
    and the pass writes its output whole (the first), one vector at the row's start goes
    first and the loop goes on from the field's next vector-size boundary (the points in
    between computed twice, to the same value: no masked vector, which costs several plain
    ones on AMD's cores), so the full vectors' loads of every row the stencil reads do not
    straddle cache lines: a load across a line takes two of the core's load slots, and a
    high-order stencil is bound by its loads. Only where the row pitch is a multiple of the
    vector (then one boundary aligns every row): with another pitch the rows' offsets from the
    boundary differ, and a probe of ete73 (pitch 268) found the extra vector a row cost more
    than it saved; without vectors (the function carries ``NOVEC``) the x one
    at a time throughout. Each row's terms are added in point order, one rounding per multiply and per add
    (or per FMA when contraction is on), in both loops. ``init``: the (vector, scalar)
    start of a one-row block's sum instead of 0 (first pass) or the output, the vector one a
    template whose ``{ld}`` is the load macro (masked in the row's tail)."""
    assert init is None or len(block) == 1, "an init expression is for one row"
    accs = [f"a{i}" for i in range(len(block))]
    value_major = s.vectorize and not s.factor and _ascending(lay, points)
    vl = ISAS[s.isa][0]
    # non-temporal stores: the rows whose output is on a vector boundary when the first row's is
    nt = s.nt and first and init is None and s.vectorize
    nt_rows = {r for r in block if lay.field_row(r) % vl == 0} if nt else set()

    def body(vector: bool, masked: bool = False) -> str:
        ld, st = ("LDM", "STM") if masked else ("LD", "ST")
        if init is not None:
            starts = [init[0].format(ld=ld) if vector else init[1]]
        elif first:
            starts = ["(vf){}" if vector else "0.0f"] * len(block)
        else:
            starts = [f"{ld}(o + x + {lay.field_row(r)})" if vector else f"o[x + {lay.field_row(r)}]" for r in block]
        kind = "vf" if vector else "float"
        decl = " ".join(f"{kind} {a} = {start};" for a, start in zip(accs, starts, strict=True))
        ahead = vector and not masked  # prefetches go in the full vectors' body only
        terms = _stream_prefetches(lay, points, block, s.stream, output=not nt) if ahead and s.stream else []
        if vector and value_major:  # it writes the rows' prefetches itself
            terms += _value_major_terms(lay, points, block, accs, ld, s.prefetch if ahead else 0)
        elif s.factor:  # per group and row, each field value loaded once
            terms += _prefetches(lay, points, block, s.prefetch) if ahead and s.prefetch else []
            terms += _group_terms(lay, points, block, accs, ld, vector)
        else:
            terms += [lay.term(p, r, a, vector, ld=ld) for p in points for a, r in zip(accs, block, strict=True)]
        puts = ["STNT" if r in nt_rows and not masked else st for r in block]
        store = " ".join((f"{put}(o + x + {lay.field_row(r)}, {a});" if vector else f"o[x + {lay.field_row(r)}] = {a};")
                         for put, a, r in zip(puts, accs, block, strict=True))
        return "{ " + "\n    ".join([decl, *terms, store]) + " }"

    if not s.vectorize:
        return f"{{ long x = {lo};\nfor (; x < {hi}; ++x) {{\n    {body(False)}\n}} }}"
    head = ""
    if nt:  # the first row's points up to its output's vector boundary, one masked vector
        head = (f"{{ long tk_h = (long)(((0ul - (unsigned long)(o + x)) & {4 * vl - 1}ul) >> 2);\n"
                f"if (tk_h > {hi} - x) tk_h = {hi} - x;\n"
                f"if (tk_h) {{\n    const float *q = v + x; (void)q; TK_TAIL_MASK(tk_h);\n"
                f"    {body(True, masked=True)}\n    x += tk_h;\n}} }}\n")
    elif first and init is None and not lay.stencil.arrays and lay.px % vl == 0:  # all loads aligned
        head = (f"{{ const long tk_h = (long)(((0ul - (unsigned long)(v + x)) & {4 * vl - 1}ul) >> 2);\n"
                f"if (tk_h && x + tk_h + {vl} <= {hi}) {{\n    const float *q = v + x; (void)q;\n"
                f"    {body(True)}\n    x += tk_h;\n}} }}\n")
    return (f"{{ long x = {lo};\n{head}for (; x + {vl} <= {hi}; x += {vl}) {{\n    const float *q = v + x; (void)q;\n    {body(True)}\n}}\n"
            f"if (x < {hi}) {{\n    const float *q = v + x; (void)q; TK_TAIL_MASK({hi} - x);\n    {body(True, masked=True)}\n}} }}")


def _ascending(lay: _Layout, points) -> bool:
    offsets = [lay.offset(p.offset) for p in points]
    return all(a < b for a, b in zip(offsets[:-1], offsets[1:], strict=False))


def _prefetches(lay: _Layout, points, block, prefetch: int) -> list[str]:
    """Each field row the jammed rows read, asked for ``prefetch`` floats ahead."""
    rows = sorted({lay.offset((p.offset[0], p.offset[1], 0)) + lay.field_row(r) for p in points for r in block})
    return [f"__builtin_prefetch(q + {row} + {prefetch}, 0, 3);" for row in rows]


def _stream_prefetches(lay: _Layout, points, block, ahead: int, output: bool = True) -> list[str]:
    """The rows the jammed ``block`` is the first to read in a z-major sweep, ``ahead`` floats
    on: those of the planes at the stencil's reach ahead (``dz`` + the row's plane >= the
    reach; the block before, ``rz`` planes back, read every plane below); and, with
    ``output`` (not under non-temporal stores), the block's output rows, for writing
    (locality 3: kept in every cache level)."""
    reach = max(p.offset[0] for p in points)
    rows = sorted({lay.offset((p.offset[0], p.offset[1], 0)) + lay.field_row(r)
                   for p in points for r in block if p.offset[0] + r[0] >= reach})
    return ([f"__builtin_prefetch(q + {row} + {ahead}, 0, 3);" for row in rows]
            + [f"__builtin_prefetch(o + x + {lay.field_row(r) + ahead}, 1, 3);" for r in block if output])


def _value_major_terms(lay: _Layout, points, block, accs, ld: str, prefetch: int) -> list[str]:
    """The vector body's terms with each field value loaded once: the (row, point) terms in
    ascending address order (ties: rows in turn), so with ``points`` ascending every row still
    adds its terms in the stencil's order. A value more than one row reads is pinned in a
    register. With ``prefetch``, each field row is first asked for that many floats ahead."""
    lines = _prefetches(lay, points, block, prefetch) if prefetch else []
    terms = sorted(((lay.offset(p.offset) + lay.field_row(r), i, p, a, r)
                    for i, p in enumerate(points) for a, r in zip(accs, block, strict=True)), key=lambda t: t[:2])
    uses = Counter(t[0] for t in terms)
    loaded = None
    for address, _, p, a, r in terms:
        name = _value_name(address)
        if address != loaded:
            lines.append(_load(name, address, ld, pin=uses[address] > 1))
            loaded = address
        lines.append(lay.term(p, r, a, True, value=name, ld=ld))
    return lines


def _value_name(address: int) -> str:
    return f"u{address}" if address >= 0 else f"um{-address}"


def _load(name: str, address: int, ld: str, pin: bool) -> str:
    """A field value loaded once into ``name``; ``pin``: kept in a register by an empty asm
    (GCC would otherwise fold the load into each of its uses again)."""
    return f"vf {name} = {ld}(q + {address});" + (f' __asm__("" : "+v"({name}));' if pin else "")


def _group_terms(lay: _Layout, points, block, accs, ld: str, vector: bool) -> list[str]:
    """A factored body: the groups of points sharing a coefficient in turn, each for every
    jammed row (a group's values summed in point order, then one product onto the row's sum).
    In the vector body a value more than one (group, row) reads, such as a z neighbour of two
    jammed planes, is loaded at its first use and pinned in a register (the groups of nearby
    distances come next to each other, so it is not held long); the scalar body reads each
    value where it is used."""
    jobs = [(g, a, r) for _, g in factor_groups(points) for a, r in zip(accs, block, strict=True)]
    uses = Counter(lay.offset(p.offset) + lay.field_row(r) for g, _, r in jobs for p in g)
    lines, loaded = [], set()
    for g, a, r in jobs:
        values = []
        for p in g:
            address = lay.offset(p.offset) + lay.field_row(r)
            if not vector:
                values.append(f"v[x + ({address})]")
            elif uses[address] == 1:
                values.append(f"{ld}(q + {address})")
            else:
                name = _value_name(address)
                if address not in loaded:
                    lines.append(_load(name, address, ld, pin=True))
                    loaded.add(address)
                values.append(name)
        total = values[0] if len(values) == 1 else "(" + " + ".join(values) + ")"
        lines.append(lay.term(g[0], r, a, vector, value=total, ld=ld))
    return lines


def _passes(stencil: Stencil, s: StencilSchedule) -> list[tuple]:
    return [stencil.points[r.start:r.stop] for r in split_points(len(stencil.points), s.split)]


def _nest(lay: _Layout, s: StencilSchedule, groups) -> str:
    """The z, y, x-block loops of one tile; ``groups``: (points, first pass?) x loops in each
    row. Rows go in blocks of ``s.rz`` planes x ``s.ry`` rows, the tile's leftover rows and
    planes in smaller blocks (``s.rz`` x 1, then 1 x ``s.ry`` and 1 x 1)."""
    nx = lay.shape[2]
    tx = s.tx or nx

    def rows(rz: int, ry: int, step: str) -> str:
        loops = "\n".join(_x_loop(lay, g, first, s, "bx", "x1", _rows(rz, ry)) for g, first in groups)
        return (f"for (; {step}; y += {ry})\n"
                f"for (long bx = 0; bx < {nx}; bx += {tx}) {{\nconst long x1 = tk_min(bx + {tx}, {nx});\n"
                f"{lay.row_ptrs()}\n{loops}\n}}")

    def planes(rz: int) -> str:
        jammed = rows(rz, s.ry, f"y + {s.ry} <= y1") + "\n" if s.ry > 1 else ""
        return f"{{\nlong y = by;\n{jammed}{rows(rz, 1, 'y < y1')}\n}}"

    blocked = f"for (; z + {s.rz} <= z1; z += {s.rz}) {planes(s.rz)}\n" if s.rz > 1 else ""
    return f"{{ long z = bz;\n{blocked}for (; z < z1; ++z) {planes(1)}\n}}"


def _tiles(lay: _Layout, s: StencilSchedule, inner: str) -> str:
    """The tiles (z-blocks x y-blocks) over the threads, OpenMP's guided schedule: each thread
    takes a long run of consecutive tiles first (a z range, as a static split would give it),
    then shorter ones, so a thread slowed by something else on its core (another process, a
    VM neighbour) leaves its last tiles to the others instead of holding the sweep (the
    committed Milan runs: ete73 constant's paired sweep beside Devito's 35.4 ms under the
    static split, 22.8 under this, against 23.8 and 22.5 in the quiet main process)."""
    nz, ny, _ = lay.shape
    fence = "\n_mm_sfence();  /* non-temporal stores are weakly ordered: drained before the tile ends */" if s.nt else ""
    return (f"#pragma omp parallel for collapse(2) schedule(guided) num_threads(nthreads)\n"
            f"for (long bz = 0; bz < {nz}; bz += {s.tz})\nfor (long by = 0; by < {ny}; by += {s.ty}) {{\n"
            f"const long z1 = tk_min(bz + {s.tz}, {nz}), y1 = tk_min(by + {s.ty}, {ny});\n{inner}{fence}\n}}")


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
        _vector_types(s.isa) if s.vectorize else "",
        f"{attr}void tk_run(float *restrict out, const float *restrict u, const float *const *coefs, int nthreads) {{",
        "  (void)coefs; (void)nthreads;", lay.decls(s.vectorize), nests, "}",
    ]) + "\n"


def generate_wave(stencil: Stencil, shape: tuple[int, int, int], s: StencilSchedule) -> str:
    """C for ``steps`` leapfrog steps, next = 2 cur - prev + stencil(cur) (+ the source), in
    place: ``a`` holds u(n-1) and ``b`` u(n); step k writes into the buffer of u(n-1+k).
    ``time_block`` steps share one sweep over z, step k at plane p - k r (r the radius):
    step k+1 at plane z needs step k's planes up to z + r, and overwrites a plane step k
    has finished reading, so one barrier per plane step keeps it exact."""
    if s.nt:
        raise ValueError("nt=True: the wave kernel reads the buffer it writes (non-temporal stores apply to apply)")
    lay = _Layout(stencil, shape)
    nz, ny, nx = shape
    r, tb = max(1, stencil.radius), s.time_block
    x_loop = _x_loop(lay, stencil.points, False, s, "0", str(nx), [(0, 0)],
                     init=("2.0f * {ld}(q) - {ld}(o + x)", "2.0f * v[x] - o[x]"))
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
        _vector_types(s.isa) if s.vectorize else "",
        f"{attr}void tk_wave(float *restrict a, float *restrict b, const float *const *coefs, const float *restrict src,"
        " long sz, long sy, long sx, long steps, int nthreads) {",
        "  (void)coefs;", lay.decls(s.vectorize), body, "}",
    ]) + "\n"
