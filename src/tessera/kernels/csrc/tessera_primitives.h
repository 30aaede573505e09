/* Tessera's tensorized primitives, written once: a BLIS-style register-blocked FP32
 * micro-kernel (MR x NR accumulators in vector registers, broadcast + FMA) and the packing
 * routines around it. Every generated GEMM-like kernel includes this file after defining
 *
 *   TK_VEC     256 (AVX2 + FMA, 8 floats a register) or 512 (AVX-512F, 16 floats)
 *   TK_MR      rows of the register tile (broadcast side)
 *   TK_NR      columns of the register tile (vector side), a multiple of the vector length
 *   TK_UNROLL  unroll factor of the micro-kernel's k loop
 *   TK_NG      guarded index dimensions of the packed B operand (0..4; padding of a conv)
 *   TK_PFB     rows of B ahead the micro-kernel prefetches when it reads B in place (0: none;
 *              optional, 0 when not defined)
 *
 * Layout (BLIS, "Anatomy of High-Performance Matrix Multiplication"): a packed A block is
 * a run of MR-row micro-panels, each k-major (MR floats per k); a packed B block is a run of
 * NR-column micro-panels, each k-major (NR floats per k). Tails are zero-padded in the
 * packed buffers, so the micro-kernel always computes a full tile and only the store looks
 * at the valid part. Logical operands are addressed through offset tables built from the
 * operator's affine accesses: A(m, k) = A[moff[m] + koff[k]], B(k, n) = B[koff[k] + noff[n]];
 * that is what lets one packing routine serve a matrix, a transposed matrix and the
 * implicit im2col of a convolution (guarded dimensions read as zero outside [0, limit)).
 */
#ifndef TESSERA_PRIMITIVES_H
#define TESSERA_PRIMITIVES_H

#include "tessera_vec.h"

#if TK_NR % TK_VL != 0
#error "TK_NR must be a multiple of the vector length"
#endif
#define TK_NV (TK_NR / TK_VL)
#ifndef TK_PREFETCH_C
#define TK_PREFETCH_C 1
#endif
#ifndef TK_PFB
#define TK_PFB 0
#endif
/* Step k of the register tile's sums: acc[i][j] += A(i, k) B(k, j-th vector). B read in place
 * (its rows b_rs floats apart, not the packed NR) with TK_PFB: row k + TK_PFB asked for first.
 * Each row of a B panel read in place is a short run on a page of its own, which the hardware
 * prefetchers do not follow: a 1x1 convolution's GEMM (64 x 3136 x 256) ran at 143 GFLOP/s,
 * 159 with rows fetched 8-16 ahead, 135 packing B. */
TK_INLINE void tk_tile_fmas(long k, const float *restrict a, long a_rs, long a_cs, const tk_vf bv[TK_NV],
                            tk_vf acc[TK_MR][TK_NV]) {
    for (int i = 0; i < TK_MR; ++i) {
        tk_vf ai = tk_set1(a[i * a_rs + k * a_cs]);
        for (int j = 0; j < TK_NV; ++j) acc[i][j] = tk_fma(ai, bv[j], acc[i][j]);
    }
}

TK_INLINE void tk_tile_step(long k, const float *restrict a, long a_rs, long a_cs,
                            const float *restrict b, long b_rs, tk_vf acc[TK_MR][TK_NV]) {
    tk_vf bv[TK_NV];
#if TK_PFB
    if (b_rs != TK_NR)
        for (int j = 0; j < TK_NV; ++j) _mm_prefetch((const char *)(b + (k + TK_PFB) * b_rs + j * TK_VL), _MM_HINT_T0);
#endif
    for (int j = 0; j < TK_NV; ++j) bv[j] = tk_load(b + k * b_rs + j * TK_VL);
    tk_tile_fmas(k, a, a_rs, a_cs, bv, acc);
}

/* The same step with B read in place (rows b_rs floats apart) and each row also stored into
 * the packed micro-panel bp (NR floats per k), row k + TK_PACK_AHEAD asked for first. */
#define TK_PACK_AHEAD 12
TK_INLINE void tk_tile_step_packing(long k, const float *restrict a, long a_rs, long a_cs,
                                    const float *restrict b, long b_rs, float *restrict bp,
                                    tk_vf acc[TK_MR][TK_NV]) {
    tk_vf bv[TK_NV];
    for (int j = 0; j < TK_NV; ++j) _mm_prefetch((const char *)(b + (k + TK_PACK_AHEAD) * b_rs + j * TK_VL), _MM_HINT_T0);
    for (int j = 0; j < TK_NV; ++j) {
        bv[j] = tk_load(b + k * b_rs + j * TK_VL);
        tk_store(bp + k * TK_NR + j * TK_VL, bv[j]);
    }
    tk_tile_fmas(k, a, a_rs, a_cs, bv, acc);
}

/* The register tile's sums, acc[i][j] = sum_k A(i, k) B(k, j-th vector), from zero. */
TK_INLINE void tk_tile_sums(long kc, const float *restrict a, long a_rs, long a_cs,
                            const float *restrict b, long b_rs, tk_vf acc[TK_MR][TK_NV]) {
    for (int i = 0; i < TK_MR; ++i)
        for (int j = 0; j < TK_NV; ++j) acc[i][j] = tk_zero();
    TK_UNROLL_LOOP(TK_UNROLL)
    for (long k = 0; k < kc; ++k) tk_tile_step(k, a, a_rs, a_cs, b, b_rs, acc);
}

#define TK_PF_STEPS 8
/* A row of NR floats of B's matrix into L2: its vectors' lines, one more when it starts off a line. */
TK_INLINE void tk_prefetch_b_row(const float *row) {
    for (int j = 0; j < TK_NV; ++j) _mm_prefetch((const char *)(row + j * TK_VL), _MM_HINT_T1);
    if (((size_t)row & 63) != 0) _mm_prefetch((const char *)(row + TK_NR - 1), _MM_HINT_T1);
}

TK_INLINE void tk_fetch_item(const char *p, int rows) {
    if (rows)
        tk_prefetch_b_row((const float *)p);
    else
        _mm_prefetch(p, _MM_HINT_T1);
}

/* The same sums (the same order: the same bits) with items [i0, i1) fetched into L2 on the
 * way, a few every TK_PF_STEPS steps of the k loop: item i at pf + i * stride bytes, a cache
 * line (rows 0: the next panel of an operand read from memory, a prepacked weight) or a row of
 * NR floats of B's matrix (rows 1: see tk_ukernel_pfrows). `rows` is a literal at every call,
 * so each inlined copy fetches one kind. Issued all at once before the tile, those prefetches
 * filled the core's miss buffers and held the FMAs back until the lines came, so the fetch and
 * the arithmetic took turns (a whole BERT-base's dense layers at 64 rows: 78.9 -> 59.1 ms). */
TK_INLINE void tk_tile_sums_fetching(long kc, const float *restrict a, long a_rs, long a_cs,
                                     const float *restrict b, long b_rs, tk_vf acc[TK_MR][TK_NV],
                                     const char *pf, long stride, long i0, long i1, int rows) {
    for (int i = 0; i < TK_MR; ++i)
        for (int j = 0; j < TK_NV; ++j) acc[i][j] = tk_zero();
    long groups = kc / TK_PF_STEPS, per = groups ? (i1 - i0 + groups - 1) / groups : 0, l = i0, k = 0;
    for (long g = 0; g < groups; ++g) {
        TK_UNROLL_LOOP(TK_PF_STEPS)
        for (long s = 0; s < TK_PF_STEPS; ++s, ++k) tk_tile_step(k, a, a_rs, a_cs, b, b_rs, acc);
        for (long q = 0; q < per && l < i1; ++q, ++l) tk_fetch_item(pf + l * stride, rows);
    }
    for (; k < kc; ++k) tk_tile_step(k, a, a_rs, a_cs, b, b_rs, acc);
    for (; l < i1; ++l) tk_fetch_item(pf + l * stride, rows);
}

/* npf cache lines from pf (a prepacked operand's next panel). */
TK_INLINE void tk_tile_sums_pf(long kc, const float *restrict a, long a_rs, long a_cs,
                               const float *restrict b, long b_rs, tk_vf acc[TK_MR][TK_NV],
                               const char *pf, long npf) {
    tk_tile_sums_fetching(kc, a, a_rs, a_cs, b, b_rs, acc, pf, 64, 0, npf, 0);
}

/* Call `call` of `calls` over one panel takes its share of the next panel's `lines` cache lines
 * (from `next`) to prefetch on the way: the first line of the share, its count in *npf. */
TK_INLINE const char *tk_pf_share(const char *next, long lines, long calls, long call, long *npf) {
    long per = (lines + calls - 1) / calls, l0 = call * per, l1 = tk_min(l0 + per, lines);
    *npf = l1 > l0 ? l1 - l0 : 0;
    return next + l0 * 64;
}

/* Ask for the lines of C's tile, read (or written) only after the k loop, so that they arrive
 * while the FMAs run instead of stalling the loads at the end. */
TK_INLINE void tk_prefetch_c_tile(float *restrict c, const long *restrict crow, const long *restrict ncol, long mr) {
#if TK_PREFETCH_C
    for (long i = 0; i < mr; ++i)
        for (long j = 0; j < TK_NR; j += 16) _mm_prefetch((const char *)(c + crow[i] + (ncol ? 0 : j)), _MM_HINT_T0);
#else
    (void)c; (void)crow; (void)ncol; (void)mr;
#endif
}

/* C's tile (+)= acc: its valid mr x nr part (see tk_ukernel). */
TK_INLINE void tk_store_tile(tk_vf acc[TK_MR][TK_NV], float *restrict c, const long *restrict crow,
                             const long *restrict ncol, int first, long mr, long nr) {
    if (mr == TK_MR && nr == TK_NR && ncol == 0) {
        for (int i = 0; i < TK_MR; ++i) {
            float *cr = c + crow[i];
            for (int j = 0; j < TK_NV; ++j) {
                tk_vf v = first ? acc[i][j] : tk_add(tk_load(cr + j * TK_VL), acc[i][j]);
                tk_store(cr + j * TK_VL, v);
            }
        }
        return;
    }
    float tile[TK_MR * TK_NR] __attribute__((aligned(64)));
    for (int i = 0; i < TK_MR; ++i)
        for (int j = 0; j < TK_NV; ++j) tk_store(tile + i * TK_NR + j * TK_VL, acc[i][j]);
    for (long i = 0; i < mr; ++i) {
        float *cr = c + crow[i];
        for (long j = 0; j < nr; ++j) {
            long at = ncol ? ncol[j] : j;
            cr[at] = first ? tile[i * TK_NR + j] : cr[at] + tile[i * TK_NR + j];
        }
    }
}

/* The micro-kernel: C[rows i, cols j] (+)= sum_k A(i, k) B(k, j) for one MR x NR tile.
 * A(i, k) = a[i * a_rs + k * a_cs] (packed: a_rs = 1, a_cs = MR), B(k, :) starts at
 * b + k * b_rs (packed: b_rs = NR). Callers pass literal strides, so after inlining the
 * compiler sees constants. C row i starts at c + crow[i]; columns are contiguous when
 * ncol is NULL, else column j lives at ncol[j]. `first` overwrites instead of adding
 * (the first k block). mr, nr: the valid part of the tile.
 * pf, npf: lines to prefetch on the way (tk_tile_sums_pf), or none (npf 0, a literal at every
 * call that has none, so the plain loop is all that is compiled there). */
TK_INLINE void tk_ukernel(long kc, const float *restrict a, long a_rs, long a_cs,
                          const float *restrict b, long b_rs, float *restrict c,
                          const long *restrict crow, const long *restrict ncol,
                          int first, long mr, long nr, const char *pf, long npf) {
    tk_vf acc[TK_MR][TK_NV];
    tk_prefetch_c_tile(c, crow, ncol, mr);
    if (npf)
        tk_tile_sums_pf(kc, a, a_rs, a_cs, b, b_rs, acc, pf, npf);
    else
        tk_tile_sums(kc, a, a_rs, a_cs, b, b_rs, acc);
    tk_store_tile(acc, c, crow, ncol, first, mr, nr);
}

/* The micro-kernel of a B panel's first row tile when B is packed panel by panel as it is first
 * used: B read in place (a full NR columns, rows b_rs floats apart) and copied on the way into
 * the packed micro-panel bp that the panel's other tiles read. The same sums in the same order
 * as packing first, so the same bits; the copy's loads, which would otherwise wait on memory
 * with no arithmetic beside them, overlap the tile's FMAs (128x768x3072 on 1 thread, 8x48:
 * 163 -> 175 GFLOP/s). */
TK_INLINE void tk_ukernel_packing_b(long kc, const float *restrict a, long a_rs, long a_cs,
                                    const float *restrict b, long b_rs, float *restrict bp,
                                    float *restrict c, const long *restrict crow,
                                    const long *restrict ncol, int first, long mr, long nr) {
    tk_vf acc[TK_MR][TK_NV];
    tk_prefetch_c_tile(c, crow, ncol, mr);
    for (int i = 0; i < TK_MR; ++i)
        for (int j = 0; j < TK_NV; ++j) acc[i][j] = tk_zero();
    TK_UNROLL_LOOP(TK_UNROLL)
    for (long k = 0; k < kc; ++k) tk_tile_step_packing(k, a, a_rs, a_cs, b, b_rs, bp, acc);
    tk_store_tile(acc, c, crow, ncol, first, mr, nr);
}

/* The micro-kernel (tk_ukernel) with rows [r0, r1) of the next B panel, read from B's matrix
 * (row r at pf + r * pf_rs floats, NR floats wide), fetched into L2 on the way, a few every
 * TK_PF_STEPS steps of the k loop (the same bits). A panel read from memory by its first tile
 * alone streams at the FMAs' pace (three lines a step for 8 x 48), past one core's memory
 * bandwidth; spread over all the panel's tiles, the next panel arrives at a fraction of it. */
TK_INLINE void tk_ukernel_pfrows(long kc, const float *restrict a, long a_rs, long a_cs,
                                 const float *restrict b, long b_rs, float *restrict c,
                                 const long *restrict crow, const long *restrict ncol,
                                 int first, long mr, long nr, const float *pf, long pf_rs, long r0, long r1) {
    tk_vf acc[TK_MR][TK_NV];
    tk_prefetch_c_tile(c, crow, ncol, mr);
    tk_tile_sums_fetching(kc, a, a_rs, a_cs, b, b_rs, acc, (const char *)pf, pf_rs * (long)sizeof(float), r0, r1, 1);
    tk_store_tile(acc, c, crow, ncol, first, mr, nr);
}

/* Pack an mc x kc block of A (rows moff[0..mc), columns koff[0..kc)) into MR-row panels. */
static void tk_pack_a(const float *restrict A, const long *restrict moff,
                      const long *restrict koff, long mc, long kc, float *restrict Ap) {
    for (long ir = 0; ir < mc; ir += TK_MR) {
        long mr = tk_min(TK_MR, mc - ir);
        float *dst = Ap + ir * kc;
        const float *rows[TK_MR];
        for (int i = 0; i < TK_MR; ++i) rows[i] = A + moff[ir + (i < mr ? i : 0)];
        for (long k = 0; k < kc; ++k) {
            long ko = koff[k];
            for (int i = 0; i < TK_MR; ++i) dst[k * TK_MR + i] = i < mr ? rows[i][ko] : 0.0f;
        }
    }
}

/* Pack a kc x nc block of B whose columns are contiguous (B(k, n0 + j) = B[koff[k] + n0 + j])
 * into NR-column panels. */
static void tk_pack_b_rows(const float *restrict B, const long *restrict koff, long n0,
                           long nc, long kc, float *restrict Bp) {
    for (long jr = 0; jr < nc; jr += TK_NR) {
        long nr = tk_min(TK_NR, nc - jr);
        float *dst = Bp + jr * kc;
        for (long k = 0; k < kc; ++k) {
            const float *src = B + koff[k] + n0 + jr;
            if (nr == TK_NR) {
                for (int j = 0; j < TK_NV; ++j) tk_store(dst + k * TK_NR + j * TK_VL, tk_load(src + j * TK_VL));
            } else {
                for (long j = 0; j < TK_NR; ++j) dst[k * TK_NR + j] = j < nr ? src[j] : 0.0f;
            }
        }
    }
}

/* Guards of B's packing: index dimension g of the access is gn[g][n] + gk[g][k] + gb[g] and
 * reads as zero outside [0, lim[g]) (zero padding). A panel of NR columns whose offsets and
 * guard indices all step by constants (`step`, `gstep`) is copied as a strided run when its
 * first and last columns are in bounds; other columns are checked one by one. */
typedef struct {
    const int *gn[4];
    const int *gk[4];
    int gb[4];
    int lim[4];
} tk_guards;

TK_INLINE int tk_in_bounds(const tk_guards *g, long n, long k) {
    int ok = 1;
    for (int d = 0; d < TK_NG; ++d)
        ok &= (unsigned)(g->gn[d][n] + g->gk[d][k] + g->gb[d]) < (unsigned)g->lim[d];
    return ok;
}

/* The runs of B's NR-panels (the tables are built with the kernel): panel p's columns split
 * into runs[p].count runs; run r starts at column start[r], has len[r] columns whose offsets
 * step by step[r] (1, or a convolution's stride), and along it guard q's index steps by
 * slope[r][q] >= 0. A run's in-bounds columns are then one interval, found from its first
 * column, and copied as a vector block (step 1), a vector gather of the even elements (step
 * 2, AVX-512) or element by element. */
typedef struct {
    unsigned char count;
    unsigned char start[TK_NR], len[TK_NR], step[TK_NR], slope[TK_NR][4];
} tk_runs;

TK_INLINE void tk_copy_run(float *restrict d, const float *restrict s, long n) {
    long i = 0;
    for (; i + TK_VL <= n; i += TK_VL) tk_store(d + i, tk_load(s + i));
#if TK_VEC == 512
    if (i < n) {  /* the rest in one masked move: only s[i..n) is read */
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(d + i, k, _mm512_maskz_loadu_ps(k, s + i));
    }
#else
    for (; i < n; ++i) d[i] = s[i];
#endif
}

/* d[i] = s[i * step], i < n: a vector block (step 1), the even elements of vector pairs
 * (step 2, AVX-512: a stride-2 convolution's row) or element by element. */
TK_INLINE void tk_copy_strided(float *restrict d, const float *restrict s, long n, long step) {
    if (step == 1) {
        tk_copy_run(d, s, n);
    } else if (step == 2) {
        tk_copy_run2(d, s, n);
    } else {
        for (long i = 0; i < n; ++i) d[i] = s[i * step];
    }
}

/* ceil(a / c) and floor(a / c) for c > 0 and any sign of a (C division truncates). A stride
 * of 1 or 2 (nearly every convolution) takes no division: GCC's >> on a negative long is
 * arithmetic, so a >> 1 is floor(a / 2). */
TK_INLINE long tk_ceil_div(long a, long c) {
    if (c == 1) return a;
    if (c == 2) return -((-a) >> 1);
    return a >= 0 ? (a + c - 1) / c : -((-a) / c);
}
TK_INLINE long tk_floor_div(long a, long c) {
    if (c == 1) return a;
    if (c == 2) return a >> 1;
    return a >= 0 ? a / c : -((-a + c - 1) / c);
}

/* Pack a kc x nc block of B addressed by tables (columns noff[n0..n0+nc), rows koff[0..kc)).
 * pstep[p] is the constant offset step of NR-panel p of the whole N range, or 0 when the
 * panel is not a strided run; runs[p] its runs (a panel that crosses an output row of a
 * convolution, or one the zero padding cuts). */
static void tk_pack_b_table(const float *restrict B, const long *restrict koff,
                            const long *restrict noff, const long *restrict pstep,
                            const tk_runs *restrict runs, long n0, long nc,
                            long kc, const tk_guards *g, float *restrict Bp) {
    for (long jr = 0; jr < nc; jr += TK_NR) {
        long nr = tk_min(TK_NR, nc - jr), nb = n0 + jr;
        long step = nr == TK_NR ? pstep[nb / TK_NR] : 0;
        const tk_runs *pr = runs + nb / TK_NR;
        float *dst = Bp + jr * kc;
        for (long k = 0; k < kc; ++k) {
            float *d = dst + k * TK_NR;
            const float *src = B + koff[k];
            if (step && tk_in_bounds(g, nb, k) && tk_in_bounds(g, nb + TK_NR - 1, k)) {
                tk_copy_strided(d, src + noff[nb], TK_NR, step);
                continue;
            }
            for (int j = 0; j < TK_NV; ++j) tk_store(d + j * TK_VL, tk_zero());
            for (int r = 0; r < pr->count; ++r) {
                long j0 = pr->start[r], lo = 0, hi = pr->len[r];
                for (int q = 0; q < TK_NG; ++q) {
                    long v = (long)g->gn[q][nb + j0] + g->gk[q][k] + g->gb[q], c = pr->slope[r][q];
                    if (c) {  /* index v + c i for column j0 + i: in bounds for -v <= c i <= lim - 1 - v */
                        long a = tk_ceil_div(-v, c), b = tk_floor_div(g->lim[q] - 1 - v, c) + 1;
                        lo = lo > a ? lo : a;
                        hi = hi < b ? hi : b;
                    } else if (v < 0 || v >= g->lim[q]) {
                        hi = 0;
                    }
                }
                if (lo >= hi) continue;
                tk_copy_strided(d + j0 + lo, src + noff[nb + j0 + lo], hi - lo, pr->step[r]);
            }
        }
    }
}

#endif /* TESSERA_PRIMITIVES_H */
