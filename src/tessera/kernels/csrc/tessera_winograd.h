/* Winograd convolution F(m x m, 3 x 3) for a 3x3, stride-1 convolution (groups 1, any zero
 * padding), m = 2 or 4 (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks"):
 *
 *   U[xi][k][c] = (G g_kc G^T)[xi]            the weights, (m+2)^2 values per 3x3 filter
 *   V[xi][c][t] = (B^T d_ct B)[xi]            each input tile of (m+2)^2 values, t = tile
 *   M[xi]       = U[xi] V[xi]                 (m+2)^2 GEMMs of K x C by C x T: Tessera's GEMM kernel
 *   Y tile      = A^T M[:, k, t] A            m x m outputs per tile
 *
 * The generated file defines the sizes and includes this file:
 *   WG_M (2 or 4), WG_N, WG_C, WG_K, WG_H, WG_W, WG_PH, WG_PW, WG_OH, WG_OW.
 * Transforms are vectorised across TK_VL neighbouring tiles of a tile row: each input plane
 * is copied into a zero-padded buffer with its columns split into WG_M phases (padded column
 * j lives in phase j % m at position j / m), so column j of VL neighbouring tiles is one
 * contiguous load. The GEMM is called through the pointer Python sets with wg_set_gemm.
 * Every output is computed by the same operations whatever the thread count.
 */
#ifndef TESSERA_WINOGRAD_H
#define TESSERA_WINOGRAD_H

#include "tessera_vec.h"

#define WG_A (WG_M + 2)
#define WG_XI (WG_A * WG_A)
#define WG_TH ((WG_OH + WG_M - 1) / WG_M)
#define WG_TW ((WG_OW + WG_M - 1) / WG_M)
#define WG_T ((long)WG_N * WG_TH * WG_TW)
#define WG_TWV (((WG_TW + TK_VL - 1) / TK_VL) * TK_VL)
#define WG_RW (WG_TWV + TK_VL)
#define WG_DATA_COLS ((WG_PW + WG_W + WG_M - 1) / WG_M)
#define WG_CP ((((WG_DATA_COLS > WG_RW ? WG_DATA_COLS : WG_RW) + TK_VL - 1) / TK_VL) * TK_VL)
#define WG_HPB (WG_TH * WG_M + 2 > WG_PH + WG_H ? WG_TH * WG_M + 2 : WG_PH + WG_H)
#define WG_PHASE ((long)WG_HPB * WG_CP)

#if WG_M == 2
static const float WG_BT[4][4] = {{1, 0, -1, 0}, {0, 1, 1, 0}, {0, -1, 1, 0}, {0, 1, 0, -1}};
static const float WG_G[4][3] = {{1, 0, 0}, {0.5f, 0.5f, 0.5f}, {0.5f, -0.5f, 0.5f}, {0, 0, 1}};
static const float WG_AT[2][4] = {{1, 1, 1, 0}, {0, 1, -1, -1}};
#elif WG_M == 4
static const float WG_BT[6][6] = {{4, 0, -5, 0, 1, 0},  {0, -4, -4, 1, 1, 0}, {0, 4, -4, -1, 1, 0},
                                  {0, -2, -1, 2, 1, 0}, {0, 2, -1, -2, 1, 0}, {0, 4, 0, -5, 0, 1}};
static const float WG_G[6][3] = {{1.0f / 4, 0, 0},
                                 {-1.0f / 6, -1.0f / 6, -1.0f / 6},
                                 {-1.0f / 6, 1.0f / 6, -1.0f / 6},
                                 {1.0f / 24, 1.0f / 12, 1.0f / 6},
                                 {1.0f / 24, -1.0f / 12, 1.0f / 6},
                                 {0, 0, 1}};
static const float WG_AT[4][6] = {{1, 1, 1, 1, 1, 0}, {0, 1, -1, 2, -2, 0}, {0, 1, 1, 4, 4, 0}, {0, 1, -1, 8, -8, 1}};
#else
#error "WG_M must be 2 or 4"
#endif

/* out[a] = sum_i T[a][i] in[i], the zero terms left out (the tables are constants and the
 * loops unrolled, so each output is its few non-zero terms). */
#define WG_APPLY(T, ROWS, COLS, in, out)                                         \
    do {                                                                         \
        TK_UNROLL_ALL for (int a_ = 0; a_ < (ROWS); ++a_) {                      \
            tk_vf s_ = tk_zero();                                                \
            TK_UNROLL_ALL for (int i_ = 0; i_ < (COLS); ++i_) if (T[a_][i_] != 0) \
                s_ = tk_fma(tk_set1(T[a_][i_]), (in)[i_], s_);                   \
            (out)[a_] = s_;                                                      \
        }                                                                        \
    } while (0)

typedef void (*wg_gemm_fn)(float *restrict, const float *restrict, const float *restrict, int);
static wg_gemm_fn wg_gemm;
static __thread float *wg_U, *wg_V, *wg_Mb;

void wg_set_gemm(wg_gemm_fn fn) { wg_gemm = fn; }

void tk_init(void) {}

/* U[xi][k][c] = G g_kc G^T; in0 is the weight [K, C, 3, 3]. Vectorised across TK_VL input
 * channels of one output channel (U's c is contiguous): their 3x3 filters are gathered into
 * nine vectors, then both products with G are vector FMAs. */
static void wg_weights(const float *restrict w, float *restrict U, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long k = 0; k < WG_K; ++k) {
        for (long c0 = 0; c0 < WG_C; c0 += TK_VL) {
            long count = tk_min(TK_VL, WG_C - c0);
            float gt[9][TK_VL] __attribute__((aligned(64)));
            for (long c = 0; c < TK_VL; ++c)
                for (int j = 0; j < 9; ++j) gt[j][c] = c < count ? w[(k * WG_C + c0 + c) * 9 + j] : 0.0f;
            tk_vf t[WG_A][3];
            for (int s = 0; s < 3; ++s) {  /* t = G g, column s of the filter at a time */
                tk_vf in[3] = {tk_load(gt[s]), tk_load(gt[3 + s]), tk_load(gt[6 + s])}, out[WG_A];
                WG_APPLY(WG_G, WG_A, 3, in, out);
                for (int a = 0; a < WG_A; ++a) t[a][s] = out[a];
            }
            for (int a = 0; a < WG_A; ++a) {  /* u = t G^T, row a at a time */
                tk_vf out[WG_A];
                WG_APPLY(WG_G, WG_A, 3, t[a], out);
                for (int b = 0; b < WG_A; ++b)
                    tk_store_n(U + ((long)(a * WG_A + b) * WG_K + k) * WG_C + c0, out[b], count);
            }
        }
    }
}

static void wg_fill(float *restrict buf, const float *restrict x) {
    for (long h = 0; h < WG_H; ++h) {
        const float *src = x + h * WG_W;
        float *row = buf + (WG_PH + h) * WG_CP;
        if (WG_M == 2) {
            tk_split2(row, row + WG_PHASE, src, WG_W, WG_PW);
            continue;
        }
        for (long w = 0; w < WG_W; ++w) {
            long j = WG_PW + w;
            row[(j % WG_M) * WG_PHASE + j / WG_M] = src[w];
        }
    }
}

/* V[xi][c][t] = B^T d B for every tile of every plane; in1 is the input [N, C, H, W]. */
static void wg_input(const float *restrict x, float *restrict V, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = tk_alloc(WG_M * WG_PHASE), *R = tk_alloc((long)WG_A * WG_M * WG_RW);
        memset(buf, 0, (size_t)WG_M * WG_PHASE * sizeof(float));
#pragma omp for schedule(static)
        for (long plane = 0; plane < (long)WG_N * WG_C; ++plane) {
            long n = plane / WG_C, c = plane % WG_C;
            wg_fill(buf, x + plane * (long)WG_H * WG_W);
            for (long th = 0; th < WG_TH; ++th) {
                for (int p = 0; p < WG_M; ++p) {  /* stage 1: combine the tile row's A input rows */
                    for (long pos = 0; pos < WG_RW; pos += TK_VL) {
                        tk_vf in[WG_A], out[WG_A];
                        for (int i = 0; i < WG_A; ++i) in[i] = tk_load(buf + p * WG_PHASE + (th * WG_M + i) * WG_CP + pos);
                        WG_APPLY(WG_BT, WG_A, WG_A, in, out);
                        for (int a = 0; a < WG_A; ++a) tk_store(R + ((long)a * WG_M + p) * WG_RW + pos, out[a]);
                    }
                }
                long t0 = (n * WG_TH + th) * WG_TW;
                for (long tw = 0; tw < WG_TW; tw += TK_VL) {  /* stage 2: combine columns, VL tiles at once */
                    long count = tk_min(TK_VL, WG_TW - tw);
                    for (int a = 0; a < WG_A; ++a) {
                        tk_vf in[WG_A], out[WG_A];
                        for (int j = 0; j < WG_A; ++j) in[j] = tk_load(R + ((long)a * WG_M + j % WG_M) * WG_RW + tw + j / WG_M);
                        WG_APPLY(WG_BT, WG_A, WG_A, in, out);
                        for (int b = 0; b < WG_A; ++b)
                            tk_store_n(V + ((long)(a * WG_A + b) * WG_C + c) * WG_T + t0 + tw, out[b], count);
                    }
                }
            }
        }
        free(buf);
        free(R);
    }
}

/* y = A^T M A per tile; M[xi][k][t] (read VL tiles at a time: the buffer has VL floats of slack). */
static void wg_output(const float *restrict Mb, float *restrict y, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        float *S = tk_alloc((long)WG_M * WG_A * TK_VL), *Yp = tk_alloc((long)WG_M * WG_M * WG_TWV);
#pragma omp for schedule(static)
        for (long plane = 0; plane < (long)WG_N * WG_K; ++plane) {
            long n = plane / WG_K, k = plane % WG_K;
            float *yk = y + plane * (long)WG_OH * WG_OW;
            for (long th = 0; th < WG_TH; ++th) {
                long t0 = (n * WG_TH + th) * WG_TW;
                for (long tw = 0; tw < WG_TW; tw += TK_VL) {
                    for (int b = 0; b < WG_A; ++b) {
                        tk_vf in[WG_A], out[WG_M];
                        for (int a = 0; a < WG_A; ++a) in[a] = tk_load(Mb + ((long)(a * WG_A + b) * WG_K + k) * WG_T + t0 + tw);
                        WG_APPLY(WG_AT, WG_M, WG_A, in, out);
                        for (int i = 0; i < WG_M; ++i) tk_store(S + ((long)i * WG_A + b) * TK_VL, out[i]);
                    }
                    for (int i = 0; i < WG_M; ++i) {
                        tk_vf in[WG_A], out[WG_M];
                        for (int b = 0; b < WG_A; ++b) in[b] = tk_load(S + ((long)i * WG_A + b) * TK_VL);
                        WG_APPLY(WG_AT, WG_M, WG_A, in, out);
                        for (int j = 0; j < WG_M; ++j) tk_store(Yp + ((long)i * WG_M + j) * WG_TWV + tw, out[j]);
                    }
                }
                for (int i = 0; i < WG_M; ++i) {  /* interleave the m column phases into output rows */
                    long oh = th * WG_M + i;
                    if (oh >= WG_OH) break;
                    float *row = yk + oh * WG_OW;
                    for (long ow = 0; ow < WG_OW; ++ow) row[ow] = Yp[((long)i * WG_M + ow % WG_M) * WG_TWV + ow / WG_M];
                }
            }
        }
        free(S);
        free(Yp);
    }
}

static void wg_scratch(void) {
    if (!wg_V) {
        wg_V = tk_alloc((long)WG_XI * WG_C * WG_T);
        wg_Mb = tk_alloc((long)WG_XI * WG_K * WG_T + TK_VL);
        memset(wg_Mb, 0, ((size_t)WG_XI * WG_K * WG_T + TK_VL) * sizeof(float));
    }
}

/* in0: the weight [K, C, 3, 3]; in1: the input [N, C, H, W]; out: [N, K, OH, OW]. Scratch is
 * per calling thread (allocated on its first call), so two Python threads may call at once. */
void tk_run(float *restrict out, const float *restrict in0, const float *restrict in1, int nthreads) {
    wg_scratch();
    if (!wg_U) wg_U = tk_alloc((long)WG_XI * WG_K * WG_C);
    wg_weights(in0, wg_U, nthreads);
    wg_input(in1, wg_V, nthreads);
    wg_gemm(wg_Mb, wg_U, wg_V, nthreads);
    wg_output(wg_Mb, out, nthreads);
}

/* The weight transformed once (tk_prepack, U's layout), then read by every call of
 * tk_run_prepacked, which does not read in0: oneDNN's reordered weights, for Winograd. */
long tk_prepacked_floats = (long)WG_XI * WG_K * WG_C;

void tk_prepack(const float *restrict w, float *restrict dst) { wg_weights(w, dst, 1); }

void tk_run_prepacked(float *restrict out, const float *restrict in0, const float *restrict in1,
                      const float *restrict packed, int nthreads) {
    (void)in0;
    wg_scratch();
    wg_input(in1, wg_V, nthreads);
    wg_gemm(wg_Mb, packed, wg_V, nthreads);
    wg_output(wg_Mb, out, nthreads);
}

#endif /* TESSERA_WINOGRAD_H */
