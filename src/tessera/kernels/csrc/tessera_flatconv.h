/* A convolution (one group or several, each of several input channels) as a direct GEMM over
 * "flat" padded input planes: no im2col. The generated file defines the sizes and includes
 * this file:
 *
 *   FC_N, FC_G, FC_COG, FC_CIG   images, groups, output and input channels per group
 *   FC_H, FC_W, FC_OH, FC_OW     input and output planes
 *   FC_KH, FC_KW, FC_SH, FC_SW   kernel and stride;  FC_PH, FC_PW  zero padding
 *   FC_MR, FC_NV                 register tile: output channels x vectors of output positions
 *
 * Each input channel is copied once a call into zero-padded phase planes: padded row R, column
 * C lands in phase (R % SH, C % SW) at row R / SH, column C / SW, WQ columns a row. Output
 * position (oh, ow) then reads, for tap (kh, kw), phase (kh % SH, kw % SW) at flat index
 * q + (kh / SH) * WQ + kw / SW with q = oh * WQ + ow: a stride-1 run in q for every tap, at any
 * stride. So C[co][q] = sum_k W[co][k] X[koff[k] + q] is a GEMM whose B rows are read straight
 * from the planes (koff: a table over k = (ci, kh, kw)); the columns with ow >= OW (WQ - OW of
 * every WQ) are computed and dropped. The weight rows are broadcast from the caller's
 * [G, COG, CIG, KH, KW] tensor as they are (no packing); a thread takes one block of NR
 * positions of one image and group, sums it over K in blocks of FC_KC for every output
 * channel, then copies the valid columns out as runs of consecutive outputs. Sums run over
 * k in order whatever the thread count: results do not depend on it.
 *
 * With FC_CVEC 1 the same planes feed the other orientation (oneDNN's idea for small planes
 * and groups): output channels on the vector lanes, positions broadcast. A tile is FC_MR
 * positions of one output row, or whole rows when a row is narrower (from the planes at
 * q = oh * WQ + ow, the same koff), times FC_NV vectors of a group's output channels, summed
 * over K in blocks (partial sums kept per tile between them); its B is the weight transposed
 * to [K][NV * VL] per block of channels (packed once a call by tk_run, or once for good by
 * tk_prepack for tk_run_prepacked). No column is computed and dropped (a row's last tile
 * overlaps the one before it when MR does not divide OW: the same sums, so the same bits);
 * the tiles are written to the NCHW output through register transposes. Needs FC_COG a
 * multiple of NV * VL.
 */
#ifndef TESSERA_FLATCONV_H
#define TESSERA_FLATCONV_H

#include "tessera_vec.h"

#ifndef FC_CVEC
#define FC_CVEC 0
#endif
#define FC_NR (FC_NV * TK_VL)
#define FC_K (FC_CIG * FC_KH * FC_KW)
#define FC_KC 128
#define FC_HP_DATA (FC_PH + FC_H)
#define FC_HP_READ ((FC_OH - 1) * FC_SH + FC_KH)
#define FC_HP (FC_HP_DATA > FC_HP_READ ? FC_HP_DATA : FC_HP_READ)
#define FC_WP_DATA (FC_PW + FC_W)
#define FC_WP_READ ((FC_OW - 1) * FC_SW + FC_KW)
#define FC_WP (FC_WP_DATA > FC_WP_READ ? FC_WP_DATA : FC_WP_READ)
#define FC_HQ ((FC_HP + FC_SH - 1) / FC_SH)
#define FC_WQ ((FC_WP + FC_SW - 1) / FC_SW)
#define FC_Q ((long)FC_OH * FC_WQ)
#define FC_KMAX (((FC_KH - 1) / FC_SH) * FC_WQ + (FC_KW - 1) / FC_SW)
#if FC_CVEC
#define FC_READ ((long)(FC_OH - 1) * FC_WQ + FC_OW + FC_KMAX)
#else
#define FC_QB ((FC_Q + FC_NR - 1) / FC_NR)
#define FC_READ ((long)FC_QB * FC_NR + FC_KMAX)
#endif
#define FC_PLANE ((long)FC_HQ * FC_WQ > FC_READ ? (long)FC_HQ * FC_WQ : FC_READ)
#define FC_CH ((long)FC_SH * FC_SW * FC_PLANE)
#define FC_GROUP ((long)FC_CIG * FC_CH)
#if FC_CVEC
#define FC_CB (FC_COG / FC_NR) /* blocks of output channels a group */
#if FC_COG % FC_NR != 0
#error "NV vectors must divide the output channels of a group"
#endif
#else
#define FC_ITEMS ((long)FC_N * FC_G * FC_QB)
#if FC_COG % FC_MR != 0
#error "FC_MR must divide the output channels of a group"
#endif
#endif

static long fc_koff[FC_K];

void tk_init(void) {
    long k = 0;
    for (long c = 0; c < FC_CIG; ++c)
        for (long r = 0; r < FC_KH; ++r)
            for (long s = 0; s < FC_KW; ++s)
                fc_koff[k++] = (c * FC_SH * FC_SW + (r % FC_SH) * FC_SW + s % FC_SW) * FC_PLANE +
                               (r / FC_SH) * FC_WQ + s / FC_SW;
}

/* The padded phase planes of one input channel; the padding stays as zeroed at allocation
 * (every call writes the same positions). */
static void fc_fill(float *restrict ch, const float *restrict x) {
    for (long h = 0; h < FC_H; ++h) {
        const float *src = x + h * FC_W;
        long r = FC_PH + h;
        float *row = ch + (r % FC_SH) * FC_SW * FC_PLANE + (r / FC_SH) * FC_WQ;
        if (FC_SW == 1) {
            memcpy(row + FC_PW, src, FC_W * sizeof(float));
        } else if (FC_SW == 2) {
            tk_split2(row, row + FC_PLANE, src, FC_W, FC_PW);
        } else {
            for (long w = 0; w < FC_W; ++w) {
                long j = FC_PW + w;
                row[(j % FC_SW) * FC_PLANE + j / FC_SW] = src[w];
            }
        }
    }
}

/* The padded phase planes of the call's input, grown once and kept by the calling thread (a
 * fresh buffer of several MiB costs a page fault per 4 KiB on every call); its padding is
 * zeroed when it is allocated. */
static __thread float *fc_planes;

static float *fc_fill_all(const float *restrict in1, int nthreads) {
    if (!fc_planes) {
        fc_planes = tk_alloc((long)FC_N * FC_G * FC_GROUP);
        memset(fc_planes, 0, (size_t)FC_N * FC_G * FC_GROUP * sizeof(float));
    }
    float *planes = fc_planes;
    const long channels = (long)FC_N * FC_G * FC_CIG;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (long c = 0; c < channels; ++c) fc_fill(planes + c * FC_CH, in1 + c * (long)FC_H * FC_W);
    return planes;
}

#if FC_CVEC

long tk_prepacked_floats = (long)FC_G * FC_COG * FC_K;

/* dst[((g * CB + cb) * K + k) * NR + j] = W[g][cb * NR + j][k]: each block of NR output
 * channels of a group as the rows of a [K][NR] matrix. */
static void fc_pack_weight(float *restrict dst, const float *restrict w, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (long b = 0; b < (long)FC_G * FC_CB; ++b) {
        const float *src = w + b * FC_NR * (long)FC_K;
        tk_transpose(dst + b * FC_NR * (long)FC_K, FC_NR, src, FC_K, FC_NR, FC_K);
    }
}

void tk_prepack(const float *restrict w, float *restrict dst) { fc_pack_weight(dst, w, 1); }

/* A tile's MR positions: TR output rows of TC columns (TC = MR, or OW when a row is narrower
 * than MR: 7x7 planes take two rows of 7). The last tile of a row, and the last row tile of a
 * plane, overlap the one before them when they do not divide it: the same sums, so the same
 * bits, written twice. */
#ifndef FC_LIN
#define FC_LIN 0
#endif
#define FC_P ((long)FC_OH * FC_OW)
#if FC_LIN
/* Linear tiles (FC_LIN 1): a tile is MR consecutive positions of the plane in row-major order,
 * across row ends, the last one overlapping the one before it; each position's place in the
 * planes is a pointer set per tile (xp in fc_ctile), so no position is computed twice but in the last
 * tile. 7x7 planes in tiles of 6 compute 54 positions for 49, where tiles of one row compute
 * 7 x 12 = 84. The whole plane is one item's band (its sums stay near 64 KiB: the space offers
 * it only where they do). */
#define FC_TC FC_MR
#define FC_TR 1
#define FC_TW ((FC_P + FC_MR - 1) / FC_MR)
#define FC_TH 1
#if FC_OH * FC_OW < FC_MR
#error "linear flatc tiles need at least MR positions in a plane"
#endif
#else
#define FC_TC (FC_OW < FC_MR ? FC_OW : FC_MR)
#define FC_TR (FC_MR / FC_TC)
#define FC_TW ((FC_OW + FC_TC - 1) / FC_TC)     /* tiles along a row */
#define FC_TH ((FC_OH + FC_TR - 1) / FC_TR)     /* row tiles down a plane */
#endif
/* Row tiles an item takes (its partial sums, RB x TW tiles of MR x NR floats, stay near
 * 64 KiB) and the k block (its [KC][NR] slice of the weight, 16 KiB, is read from L1 by every
 * tile of the item, beside the input rows it meets: a 32 KiB slice ran 5% slower on 7x7
 * planes, measured). */
#define FC_RB_FIT (16384 / ((long)FC_TW * FC_MR * FC_NR))
#define FC_RB (FC_RB_FIT < 1 ? 1 : FC_RB_FIT > FC_TH ? FC_TH : FC_RB_FIT)
#define FC_THB ((FC_TH + FC_RB - 1) / FC_RB)
/* FC_LIN: every tile of the item reads the whole plane of each input channel its k block
 * covers, so the block's input channels (their phase planes) are held to 16 KiB of L1 too (a 1x1
 * convolution on 7x7 planes took 256 channels, 50 KiB, a block, and its broadcasts came from
 * L2: 54 GFLOP/s, Milan, 1 thread) */
#define FC_KC_W (4096 / FC_NR)
#define FC_KC_X ((4096L * FC_KH * FC_KW) / FC_CH / 8 * 8) /* whole 8 x 8 transposes */
#define FC_KC_FIT (FC_LIN && FC_KC_X < FC_KC_W ? (FC_KC_X < 8 ? 8 : FC_KC_X) : FC_KC_W)
#define FC_KCC (FC_K <= FC_KC_FIT + FC_KC_FIT / 2 ? FC_K : FC_KC_FIT)
long tk_flat_kc = FC_KCC; /* the k block, read by the tests against the model's (direct.flatcl_k_block) */
/* Where each block of NR output channels is read by one item only (one image, one band of
 * rows: a small plane), its weight is transposed slice by slice as the item reaches it, into
 * a buffer of the thread's, the next slice fetched on the way: the weight is read once a
 * call, not read, written and read again (n1 c512->512 7x7 3x3: 100 GFLOP/s transposing it
 * whole first, 171 with it transposed once for good). */
#define FC_WFUSE (FC_N * FC_THB == 1)
#define FC_LPR ((FC_KCC + 15) / 16) /* cache lines of one weight row's slice */
TK_INLINE const float *fc_pf_line(const float *next, long l) { return next + (l / FC_LPR) * (long)FC_K + (l % FC_LPR) * 16; }

#if !FC_LIN && (FC_MR % FC_TC != 0 || FC_TR > FC_OH)
#error "a flatc tile wider than a row must be whole rows of it, no more than the plane has"
#endif

#if FC_LIN
TK_INLINE long fc_col0(long t) { return (t * FC_MR + FC_MR > FC_P) ? FC_P - FC_MR : t * FC_MR; }
#else
TK_INLINE long fc_col0(long t) { return (t * FC_TC + FC_TC > FC_OW) ? FC_OW - FC_TC : t * FC_TC; }
#endif
TK_INLINE long fc_qpos(long p) { return (p / FC_OW) * FC_WQ + p % FC_OW; } /* position p in the planes */
TK_INLINE long fc_row0(long r) { return (r * FC_TR + FC_TR > FC_OH) ? FC_OH - FC_TR : r * FC_TR; }

/* acc[i][v] (+)= sum over kc of x[koff[k] + pos(i)] * wt[k * NR + v * VL ...]: MR positions
 * (broadcast) times NV vectors of output channels. The partial sums between k blocks live in
 * the tile's own slot (tiles that overlap must not share them); the last block writes the
 * tile position-major into rows (OW positions a row). */
/* xp: the tile's positions in the planes (FC_LIN: one pointer each, read at the tap's offset, a
 * single address mode), else unused */
TK_INLINE void fc_cstep(long k, const float *restrict x, const long *restrict koff, const float *restrict wt,
                        const float *const *xp, tk_vf acc[FC_MR][FC_NV]) {
    const long ko = koff[k];
    const float *xk = x + ko;
    const float *wk = wt + k * FC_NR;
    tk_vf bv[FC_NV];
    TK_UNROLL_ALL
    for (int v = 0; v < FC_NV; ++v) bv[v] = tk_load(wk + v * TK_VL);
    TK_UNROLL_ALL
    for (int i = 0; i < FC_MR; ++i) {
        tk_vf xi = tk_set1(FC_LIN ? xp[i][ko] : xk[(i / FC_TC) * FC_WQ + i % FC_TC]);
        TK_UNROLL_ALL
        for (int v = 0; v < FC_NV; ++v) acc[i][v] = tk_fma(xi, bv[v], acc[i][v]);
    }
}

/* pf: lines [l0, l1) of the weight's next slice to fetch into L2 on the way, one every
 * FC_PF_EVERY k steps (see fc_pf_line); none when l1 <= l0. */
#define FC_PF_EVERY 2
TK_INLINE void fc_ctile(long kc, const float *restrict x, const long *restrict koff, const float *restrict wt,
                        float *restrict slot, int first, int last, float *restrict rows,
                        const float *pf, long l0, long l1, long p0) {
    tk_vf acc[FC_MR][FC_NV];
    const float *xp[FC_MR];
    TK_UNROLL_ALL
    for (int i = 0; i < FC_MR; ++i) xp[i] = x + (FC_LIN ? fc_qpos(p0 + i) - fc_qpos(p0) : 0);
    TK_UNROLL_ALL
    for (int i = 0; i < FC_MR; ++i)
        TK_UNROLL_ALL
        for (int v = 0; v < FC_NV; ++v) acc[i][v] = first ? tk_zero() : tk_load(slot + i * FC_NR + v * TK_VL);
    long k = 0;
    if (l1 > l0) {
        for (; k + FC_PF_EVERY <= kc; k += FC_PF_EVERY) {
            TK_UNROLL_ALL
            for (int s = 0; s < FC_PF_EVERY; ++s) fc_cstep(k + s, x, koff, wt, xp, acc);
            if (l0 < l1) _mm_prefetch((const char *)fc_pf_line(pf, l0++), _MM_HINT_T1);
        }
        while (l0 < l1) _mm_prefetch((const char *)fc_pf_line(pf, l0++), _MM_HINT_T1);
    }
    TK_UNROLL_LOOP(2)
    for (; k < kc; ++k) fc_cstep(k, x, koff, wt, xp, acc);
    TK_UNROLL_ALL
    for (int i = 0; i < FC_MR; ++i)
        TK_UNROLL_ALL
        for (int v = 0; v < FC_NV; ++v)
            tk_store(last ? rows + ((i / FC_TC) * FC_OW + i % FC_TC) * FC_NR + v * TK_VL : slot + i * FC_NR + v * TK_VL, acc[i][v]);
}

/* An item: RB row tiles of one image and group, NR output channels; its partial sums are
 * kept position-major for whole rows (from its first row tile's first row), then written to
 * the output's [channel][position] rows by one transposed copy of the rows it owns. */
#define FC_CITEMS ((long)FC_N * FC_G * FC_CB * FC_THB)

/* packed: the weight transposed whole ([K][NR] per block), or NULL to transpose each item's
 * slices from w ([G, COG, K]) as it goes (FC_WFUSE). */
static void fc_run_cvec(float *restrict out, const float *restrict packed, const float *restrict w,
                        const float *restrict planes, int nthreads) {
    if (nthreads > FC_CITEMS) nthreads = (int)FC_CITEMS;
#pragma omp parallel num_threads(nthreads)
    {
        float *cbuf = tk_alloc(FC_LIN ? FC_P * FC_NR : ((long)FC_RB + 1) * FC_TR * FC_OW * FC_NR);
        float *slots = FC_K > FC_KCC ? tk_alloc((long)FC_RB * FC_TW * FC_MR * FC_NR) : NULL;
        float *wslice = packed ? NULL : tk_alloc((long)FC_KCC * FC_NR);
#pragma omp for schedule(static)
        for (long item = 0; item < FC_CITEMS; ++item) {
            long hb = item % FC_THB, rest = item / FC_THB, cb = rest % FC_CB, ng = rest / FC_CB, g = ng % FC_G;
            long r0 = hb * FC_RB, rts = tk_min(FC_RB, FC_TH - r0), base = fc_row0(r0);
            const float *wt = packed ? packed + (g * FC_CB + cb) * FC_NR * (long)FC_K : NULL;
            const float *wrows = w + (g * FC_CB + cb) * FC_NR * (long)FC_K; /* the block's NR rows of K */
            const float *xg = planes + ng * FC_GROUP;
            for (long k0 = 0; k0 < FC_K; k0 += FC_KCC) {
                long kc = tk_min(FC_KCC, FC_K - k0), tiles = rts * FC_TW, lines = 0;
                const float *wk = wt ? wt + k0 * FC_NR : wslice;
                if (!wt) { /* this slice transposed now; the next one's NR rows fetched by the tiles */
                    tk_transpose(wslice, FC_NR, wrows + k0, FC_K, FC_NR, kc);
                    lines = k0 + kc < FC_K ? FC_NR * FC_LPR : 0;
                }
                long per = (lines + tiles - 1) / tiles;
                for (long r = 0; r < rts; ++r)
                    for (long t = 0; t < FC_TW; ++t) {
                        long oh = fc_row0(r0 + r), ow = fc_col0(t), l0 = (r * FC_TW + t) * per;
                        /* FC_LIN: oh is 0 and ow the tile's first position p0 of the plane */
                        fc_ctile(kc, xg + (FC_LIN ? fc_qpos(ow) : oh * (long)FC_WQ + ow), fc_koff + k0, wk,
                                 slots + (r * FC_TW + t) * FC_MR * FC_NR, k0 == 0, k0 + kc == FC_K,
                                 cbuf + ((oh - base) * FC_OW + ow) * FC_NR, wrows + k0 + kc, l0, tk_min(lines, l0 + per), ow);
                    }
            }
            /* rows no other item writes (FC_LIN: the whole plane) */
            long own0 = FC_LIN ? 0 : r0 * FC_TR, own1 = FC_LIN ? FC_OH : tk_min(FC_OH, (r0 + rts) * FC_TR);
            float *y = out + (ng * (long)FC_COG + cb * FC_NR) * FC_OH * FC_OW + own0 * FC_OW;
            tk_transpose(y, (long)FC_OH * FC_OW, cbuf + (own0 - base) * FC_OW * FC_NR, FC_NR, (own1 - own0) * FC_OW, FC_NR);
        }
        free(cbuf);
        free(slots);
        free(wslice);
    }
}

/* The weight transposed once a call, kept by the calling thread like the planes. */
static __thread float *fc_wt;

/* in0: the weight [G, COG, CIG, KH, KW]; in1: the input [N, G, CIG, H, W]. */
void tk_run(float *restrict out, const float *restrict in0, const float *restrict in1, int nthreads) {
    const float *planes = fc_fill_all(in1, nthreads);
    if (FC_WFUSE) {
        fc_run_cvec(out, NULL, in0, planes, nthreads);
        return;
    }
    if (!fc_wt) fc_wt = tk_alloc(tk_prepacked_floats);
    fc_pack_weight(fc_wt, in0, nthreads);
    fc_run_cvec(out, fc_wt, in0, planes, nthreads);
}

/* The same with the weight packed once by tk_prepack (in0 is not read). */
void tk_run_prepacked(float *restrict out, const float *restrict in0, const float *restrict in1,
                      const float *restrict packed, int nthreads) {
    fc_run_cvec(out, packed, in0, fc_fill_all(in1, nthreads), nthreads);
}

#else /* FC_CVEC */

/* dst[0, n) = src[0, n): whole vectors, the last one overlapping the one before it; under a
 * vector, halves, quarters and single lanes (no plain copy loop, which GCC turns into a memcpy
 * call, 8% of a stem convolution's time, nor a masked store, which AMD's cores run slowly) */
TK_INLINE void fc_copy_run(float *restrict dst, const float *restrict src, long n) {
    if (n >= TK_VL) {
        for (long t = 0; t < n; t += TK_VL) {
            long o = t + TK_VL <= n ? t : n - TK_VL;
            tk_store(dst + o, tk_load(src + o));
        }
        return;
    }
    long t = 0;
#if TK_VEC == 512
    if (n & 8) _mm256_storeu_ps(dst, _mm256_loadu_ps(src)), t = 8;
#endif
    if (n & 4) _mm_storeu_ps(dst + t, _mm_loadu_ps(src + t)), t += 4;
    if (n & 2) _mm_storel_pi((__m64 *)(dst + t), _mm_loadl_pi(_mm_setzero_ps(), (const __m64 *)(src + t))), t += 2;
    if (n & 1) dst[t] = src[t];
}

/* acc[i][v] = sum over kc of a[i * K + k] * b[koff[k] + v * VL ...] */
TK_INLINE void fc_tile(long kc, const float *restrict a, const float *restrict b, const long *restrict koff,
                       tk_vf acc[FC_MR][FC_NV]) {
    for (int i = 0; i < FC_MR; ++i)
        for (int v = 0; v < FC_NV; ++v) acc[i][v] = tk_zero();
    TK_UNROLL_LOOP(4)
    for (long k = 0; k < kc; ++k) {
        const float *bk = b + koff[k];
        tk_vf bv[FC_NV];
        for (int v = 0; v < FC_NV; ++v) bv[v] = tk_load(bk + v * TK_VL);
        for (int i = 0; i < FC_MR; ++i) {
            tk_vf ai = tk_set1(a[i * (long)FC_K + k]);
            for (int v = 0; v < FC_NV; ++v) acc[i][v] = tk_fma(ai, bv[v], acc[i][v]);
        }
    }
}

/* in0: the weight [G, COG, CIG, KH, KW]; in1: the input [N, G, CIG, H, W]. */
void tk_run(float *restrict out, const float *restrict in0, const float *restrict in1, int nthreads) {
    float *planes = fc_fill_all(in1, nthreads);
    if (nthreads > FC_ITEMS) nthreads = (int)FC_ITEMS;
#pragma omp parallel num_threads(nthreads)
    {
        float *cbuf = tk_alloc((long)FC_COG * FC_NR);
        long runs[FC_NR][3];
#pragma omp for schedule(static)
        for (long item = 0; item < FC_ITEMS; ++item) {
            long ng = item / FC_QB, q0 = (item % FC_QB) * FC_NR, g = ng % FC_G;
            const float *xb = planes + ng * FC_GROUP + q0;
            const float *wg = in0 + g * (long)FC_COG * FC_K;
            for (long k0 = 0; k0 < FC_K; k0 += FC_KC) {
                long kc = tk_min(FC_KC, FC_K - k0);
                for (long co = 0; co < FC_COG; co += FC_MR) {
                    tk_vf acc[FC_MR][FC_NV];
                    fc_tile(kc, wg + co * FC_K + k0, xb, fc_koff + k0, acc);
                    for (int i = 0; i < FC_MR; ++i) {
                        float *c = cbuf + (co + i) * FC_NR;
                        for (int v = 0; v < FC_NV; ++v)
                            tk_store(c + v * TK_VL, k0 ? tk_add(tk_load(c + v * TK_VL), acc[i][v]) : acc[i][v]);
                    }
                }
            }
            float *y = out + ng * (long)FC_COG * FC_OH * FC_OW;
            /* the block's kept columns as runs of consecutive outputs (a row's part, the dropped
             * columns between rows skipped), each copied a vector at a time for every channel */
            long nruns = 0;
            for (long j = 0; j < FC_NR;) {
                long q = q0 + j, oh = q / FC_WQ, ow = q % FC_WQ;
                if (oh >= FC_OH) break;
                if (ow >= FC_OW) {
                    j += FC_WQ - ow;
                    continue;
                }
                long len = tk_min(FC_OW - ow, FC_NR - j);
                runs[nruns][0] = j, runs[nruns][1] = oh * FC_OW + ow, runs[nruns][2] = len, ++nruns;
                j += len;
            }
            for (long co = 0; co < FC_COG; ++co) {
                const float *c = cbuf + co * FC_NR;
                float *yc = y + co * (long)FC_OH * FC_OW;
                for (long r = 0; r < nruns; ++r) {
                    const float *src = c + runs[r][0];
                    float *d = yc + runs[r][1];
                    fc_copy_run(d, src, runs[r][2]);
                }
            }
        }
        free(cbuf);
    }
}

#endif /* FC_CVEC */

#endif /* TESSERA_FLATCONV_H */
