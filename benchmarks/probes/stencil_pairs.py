"""The ete73 constant stencil in its pair-sum form, against the benchmark's register block.

ete73 is 3/4 of a radius-6 star plus 1/4 of the planar diagonals at distances 1..3, each
class of points one weight. With P_m the pair sum of an axis (u at +m plus u at -m), its
points group as

    out = c0 u + sum_m ks_m (Px_m u + Py_m u + Pz_m u) + sum_{m<=3} kd_m (Py_m Px_m u + Pz_m (Px_m u + Py_m u))

so the x-pair sums A_m = Px_m u and G_m = A_m + Py_m u, computed once a point and kept
(G_m for the 2m + 1 planes a z sweep needs, A_m for the rows around the output plane, or
recomputed where read), replace the 73 FMAs a point by about 49 adds and multiplies. The
kernel below does that over y blocks of whole rows, each streaming z: per plane, A_m and G_m
of the plane 3 ahead, then the outputs of the plane (or, jammed, of two planes a step, which
share the field values of their z pairs and the G_m they both read). It is a probe (the generator does not
emit it): bit-equal to its own float32 order with contraction off (checked first), timed
against the tuned 4 x 2 block (run 9's schedule) in 5 interleaved rounds, best of 5 sweeps
each; medians with the rounds' range.

    .venv/bin/python benchmarks/probes/stencil_pairs.py > benchmarks/results/intel-vm/stencil-pairs.txt
"""

import ctypes
import statistics
import time

import numpy as np

from tessera.kernels.compiler import compile_source, load
from tessera.kernels.machine import cpu_description
from tessera.stencil import compile_stencil, make_stencil, padded_shape
from tessera.stencil.codegen import _literal
from tessera.stencil.schedule import StencilSchedule

TUNED = StencilSchedule(isa="avx512", tz=8, ty=4, rz=4, ry=2)  # run 9's pick for ete73 constant


def classes(st):
    """(c0, star weights ks_1..R, diagonal weights kd_1..D, R, D), checking every point has its class's weight."""
    w = {p.offset: float(p.coeff) for p in st.points}
    radius = max(max(abs(c) for c in off) for off in w if off.count(0) == 2)
    diag = max((max(abs(c) for c in off) for off in w if off.count(0) == 1), default=0)
    ks = [w[(0, 0, m)] for m in range(1, radius + 1)]
    kd = [w[(0, m, m)] for m in range(1, diag + 1)]
    for (dz, dy, dx), wt in w.items():
        mags = sorted(abs(c) for c in (dz, dy, dx))
        want = w[(0, 0, 0)] if mags[2] == 0 else ks[mags[2] - 1] if mags[1] == 0 else kd[mags[2] - 1]
        assert mags[0] == 0 and (mags[1] in (0, mags[2])) and wt == want, (dz, dy, dx)
    return w[(0, 0, 0)], ks, kd, radius, diag


def generate(st, shape, ty: int, store_a: bool, jam: int = 1) -> str:
    """``jam`` 2: two planes' outputs a step, sharing the field values of their z pairs and the
    G_m they both read (the x pairs recomputed where read)."""
    c0, ks, kd, radius, diag = classes(st)
    nz, ny, nx = shape
    assert jam == 1 or (jam == 2 and not store_a and nz % 2 == 0)
    h, px = st.halo, nx + 2 * st.halo
    pp, ring = (ny + 2 * h) * px, 2 * diag + jam
    ya = diag if store_a else 0  # A_m's rows beyond the block (kept) or none (recomputed where read)
    src = ["#include <stdlib.h>",
           "typedef float vf __attribute__((vector_size(64)));",
           "typedef float vfu __attribute__((vector_size(64), aligned(4)));",
           "#define LD(p) (*(const vfu *)(p))", "#define ST(p, a) (*(vfu *)(p) = (a))",
           f"#define GP(m, s, j) (G + ((((m) - 1) * {ring} + (s)) * {ty} + (j)) * {nx})",
           f"#define AP(m, s, j) (A + ((((m) - 1) * {diag + 1} + (s)) * {ty + 2 * diag} + (j)) * {nx})",
           "static inline long md(long a, long b) { long r = a % b; return r < 0 ? r + b : r; }",
           "static void block(float *restrict out, const float *restrict u, long y0, long nyb,"
           " float *restrict G, float *restrict A) {",
           f"  const vf K0 = (vf){{}} + {_literal(c0)};"]
    src += [f"  const vf KS{m} = (vf){{}} + {_literal(k)};" for m, k in enumerate(ks, 1)]
    src += [f"  const vf KD{m} = (vf){{}} + {_literal(k)};" for m, k in enumerate(kd, 1)]
    src += [f"  for (long q = -{diag}; q < {nz + diag}; q++) {{",
            f"    const long gs = md(q, {ring}), as = md(q, {diag + 1}); (void)as;",
            f"    for (long j = -{ya}; j < nyb + {ya}; j++) {{",
            f"      const float *v = u + (q + {h}) * {pp}L + (y0 + j + {h}) * {px}L + {h};",
            "      const int inb = j >= 0 && j < nyb;",
            f"      for (long x = 0; x < {nx}; x += 16) {{"]
    for m in range(1, diag + 1):
        keep = f" ST(AP({m}, as, j + {diag}) + x, a{m});" if store_a else ""
        src.append(f"        vf a{m} = LD(v + x + {m}) + LD(v + x - {m});{keep}")
    src.append("        if (inb) {")
    src += [f"          ST(GP({m}, gs, j) + x, a{m} + (LD(v + x + {m * px}) + LD(v + x - {m * px})));"
            for m in range(1, diag + 1)]
    src += ["        }", "      }", "    }"]
    if jam == 1:
        src += [f"    const long z = q - {diag};", f"    if (z < 0 || z >= {nz}) continue;",
                f"    const long zs = md(z, {ring}), za = md(z, {diag + 1}); (void)za;"]
        src += [f"    const long zp{m} = md(z + {m}, {ring}), zm{m} = md(z - {m}, {ring});" for m in range(1, diag + 1)]
        src += ["    for (long j = 0; j < nyb; j++) {",
                f"      const float *v = u + (z + {h}) * {pp}L + (y0 + j + {h}) * {px}L + {h};",
                f"      float *o = out + (z + {h}) * {pp}L + (y0 + j + {h}) * {px}L + {h};",
                f"      for (long x = 0; x < {nx}; x += 16) {{",
                "        vf acc = K0 * LD(v + x);"]
        for m in range(1, radius + 1):
            g = (f"LD(GP({m}, zs, j) + x)" if m <= diag else
                 f"((LD(v + x + {m}) + LD(v + x - {m})) + (LD(v + x + {m * px}) + LD(v + x - {m * px})))")
            src.append(f"        acc = acc + KS{m} * ({g} + (LD(v + x + {m * pp}) + LD(v + x - {m * pp})));")
        for m in range(1, diag + 1):
            xy = (f"(LD(AP({m}, za, j + {diag + m}) + x) + LD(AP({m}, za, j + {diag - m}) + x))" if store_a else
                  f"((LD(v + x + {m * px + m}) + LD(v + x + {m * px - m})) + "
                  f"(LD(v + x - {m * px - m}) + LD(v + x - {m * px + m})))")
            src.append(f"        acc = acc + KD{m} * ({xy} + (LD(GP({m}, zp{m}, j) + x) + LD(GP({m}, zm{m}, j) + x)));")
        src += ["        ST(o + x, acc);"]
    else:
        src += _jammed_pair(radius, diag, nz, h, px, pp, ring)
    src += ["      }", "    }", "  }", "}", "void tk_init(void) {}",
            "void tk_run(float *restrict out, const float *restrict u, void *coefs, int nthreads) {",
            "  (void)coefs;", "  #pragma omp parallel num_threads(nthreads)", "  {",
            f"    float *G = aligned_alloc(64, {4 * diag * ring * ty * nx}),"
            f" *A = aligned_alloc(64, {4 * diag * (diag + 1) * (ty + 2 * diag) * nx});",
            "    #pragma omp for schedule(static)",
            f"    for (long b = 0; b < {-(-ny // ty)}; b++)",
            f"      block(out, u, b * {ty}, {ny} - b * {ty} < {ty} ? {ny} - b * {ty} : {ty}, G, A);",
            "    free(G); free(A);", "  }", "}"]
    return "\n".join(src)


def _jammed_pair(radius, diag, nz, h, px, pp, ring) -> list[str]:
    """Stage B for planes z and z + 1 together, once G_m of plane z + 1 + diag is in the ring."""
    reads = {m: sorted({0, 1, -m, m, 1 - m, 1 + m}) for m in range(1, diag + 1)}  # planes z + o of G_m
    offs = sorted({o for planes in reads.values() for o in planes})
    src = [f"    const long z1 = q - {diag}, z = z1 - 1;",
           f"    if (z1 < 1 || z1 >= {nz} || (z1 & 1) == 0) continue;"]
    src += [f"    const long s{o + 9} = md(z + {o}, {ring});" for o in offs]
    src += ["    for (long j = 0; j < nyb; j++) {",
            f"      const float *v = u + (z + {h}) * {pp}L + (y0 + j + {h}) * {px}L + {h};",
            f"      float *o = out + (z + {h}) * {pp}L + (y0 + j + {h}) * {px}L + {h};",
            f"      for (long x = 0; x < {px - 2 * h}; x += 16) {{"]
    src += [f"        const vf w{k + radius} = LD(v + x + {k * pp});" for k in range(-radius, radius + 2)]
    src += [f"        const vf g{m}_{o + 9} = LD(GP({m}, s{o + 9}, j) + x);" for m, planes in reads.items()
            for o in planes]
    for p in (0, 1):
        src.append(f"        vf acc{p} = K0 * w{p + radius};")
        for m in range(1, radius + 1):
            at = p * pp
            g = (f"g{m}_{p + 9}" if m <= diag else
                 f"((LD(v + x + {at + m}) + LD(v + x + {at - m})) + (LD(v + x + {at + m * px}) + LD(v + x + {at - m * px})))")
            src.append(f"        acc{p} = acc{p} + KS{m} * ({g} + (w{p + m + radius} + w{p - m + radius}));")
        for m in range(1, diag + 1):
            at = p * pp
            xy = (f"((LD(v + x + {at + m * px + m}) + LD(v + x + {at + m * px - m})) + "
                  f"(LD(v + x + {at - m * px + m}) + LD(v + x + {at - m * px - m})))")
            src.append(f"        acc{p} = acc{p} + KD{m} * ({xy} + (g{m}_{p + m + 9} + g{m}_{p - m + 9}));")
        src.append(f"        ST(o + x + {p * pp}, acc{p});")
    return src


def reference(st, u, shape):
    """The same float32 order in numpy (one rounding per multiply and per add)."""
    c0, ks, kd, radius, diag = classes(st)
    h, (nz, ny, nx) = st.halo, shape
    f32 = np.float32

    def at(dz, dy, dx):
        return u[h + dz:h + dz + nz, h + dy:h + dy + ny, h + dx:h + dx + nx]

    acc = f32(c0) * at(0, 0, 0)
    for m in range(1, radius + 1):
        g = (at(0, 0, m) + at(0, 0, -m)) + (at(0, m, 0) + at(0, -m, 0))
        acc = acc + f32(ks[m - 1]) * (g + (at(m, 0, 0) + at(-m, 0, 0)))
    for m in range(1, diag + 1):
        def xpair(dz, dy, m=m):
            return at(dz, dy, m) + at(dz, dy, -m)

        def gsum(dz, m=m):
            return xpair(dz, 0) + (at(dz, m, 0) + at(dz, -m, 0))
        acc = acc + f32(kd[m - 1]) * ((xpair(0, m) + xpair(0, -m)) + (gsum(m) + gsum(-m)))
    return acc


def pairs_kernel(st, shape, ty, store_a, contract=True, jam=1):
    flags = () if contract else ("-ffp-contract=off",)
    source = generate(st, shape, ty, store_a, jam)
    fn = load(compile_source(source, isa="avx512", name="pairs", extra_flags=flags)).tk_run
    fn.restype = None

    def run(u, out, threads):
        fn(ctypes.c_void_p(out.ctypes.data), ctypes.c_void_p(u.ctypes.data), None, ctypes.c_int(threads))
    return run


def main() -> None:
    st = make_stencil("ete73", "constant")
    print(f"# {cpu_description()}; ete73 constant; ms, median of 5 interleaved rounds (range), each the best of 5")
    small = (40, 40, 48)
    u = np.random.default_rng(1).standard_normal(padded_shape(small, st.halo)).astype(np.float32)
    for store_a, jam in ((True, 1), (False, 1), (False, 2)):
        out = np.zeros_like(u)
        pairs_kernel(st, small, 16, store_a, contract=False, jam=jam)(u, out, 2)
        h = st.halo
        same = np.array_equal(out[h:-h, h:-h, h:-h], reference(st, u, small))
        print(f"# {small} grid, A_m {'kept' if store_a else 'recomputed'}, {jam} plane{'s' if jam > 1 else ''} a step, "
              f"contraction off: bit-equal to its float32 order: {same}")
        assert same
    for n in (128, 256):
        grid = (n, n, n)
        u = np.random.default_rng(0).standard_normal(padded_shape(grid, st.halo)).astype(np.float32)
        out = np.zeros_like(u)
        tuned = compile_stencil(st, grid, TUNED)
        variants = {"tuned 4x2 block": lambda u, out, t, k=tuned: k(u, {}, out=out, threads=t),
                    "pairs, A_m kept": pairs_kernel(st, grid, 16, True),
                    "pairs, A_m recomputed": pairs_kernel(st, grid, 16, False),
                    "pairs, A_m recomputed, 2 planes a step": pairs_kernel(st, grid, 16, False, jam=2)}
        for threads in (1, 2):
            times = {name: [] for name in variants}
            for _ in range(5):
                for name, run in variants.items():
                    run(u, out, threads)
                    best = float("inf")
                    for _ in range(5):
                        t0 = time.perf_counter()
                        run(u, out, threads)
                        best = min(best, time.perf_counter() - t0)
                    times[name].append(best * 1e3)
            print(f"{n}^3, {threads} thread{'s' if threads > 1 else ''}: " + "; ".join(
                f"{name} {statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})" for name, t in times.items()))


if __name__ == "__main__":
    main()
