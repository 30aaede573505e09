/* The operator compiler's GEMM on AMX tiles at float32 accuracy: C[M, N] = A[M, K] B (B stored
 * [K, N], or [N, K] when GA_TB), the dense layer of tessera_amx.h with no bias and M fixed. B
 * is split into its three bfloat16 parts and laid out as tiles at each call (or once, by
 * tk_prepack, for a B that does not change: a layer's weight), A block by block inside the
 * layer. GA_BATCH products share A, each with a B and a C of its own, one after the other: a
 * 1x1 convolution of stride 1 (A its weight [C_out, C_in], B an image [C_in, H W], C the
 * image's output), or (GA_CONV) any convolution of one group, B the image's im2col matrix
 * gathered a tile at a time. The generated file defines TK_VEC (512), TK_N, TK_K, TK_KC, TK_MB,
 * GA_M, GA_TB, GA_BATCH and GA_FUSED (and GA_CONV's), then includes this file.
 */
#ifndef TESSERA_GEMM_AMX_H
#define TESSERA_GEMM_AMX_H

#include <stdint.h>

/* GA_CONV: B is a convolution's input [images, C_in, GA_H, GA_W] read as its im2col matrix
 * [C_in KH KW, images OH OW] (k = (c, r, s) in the weight's order, column (image, oy, ox)), the
 * images side by side (one product of TK_N = images x GA_P columns, C written back image by
 * image: TK_Y_PLANE): each tile of B gathered from the input as it is split, the matrix never
 * written out; the generated file then defines GA_H, GA_W, GA_KH, GA_KW, GA_SH, GA_SW, GA_PH,
 * GA_PW, GA_OW and GA_P (OH OW) too, and GA_BATCH 1. */
#ifndef GA_CONV
#define GA_CONV 0
#endif
#if GA_CONV
static void ga_conv_tile(const float *restrict X, long sk, long sn, long n0, long k0, uint16_t *restrict dst,
                         long plane);
#define TK_B_TILE ga_conv_tile
#define GA_BSTRIDE 0 /* the images side by side along N: one product */
#define TK_Y_PLANE GA_P /* C: [images][GA_M][OH OW] */
#define TK_Y_ROWS GA_M
#else
#define GA_BSTRIDE ((long)TK_K * TK_N)
#endif

#include "tessera_amx.h"

long tk_prepacked_floats = 3L * TK_NT * TK_KT * TK_TILE / 2;

#if GA_CONV
/* 16 values of im2col row k for the positions whose input row and column of tap (0, 0) are y0
 * and x0 (valid: positions inside OH OW): the image's values, 0 in the padding */
TK_INLINE __m512 ga_conv_row(const float *restrict X, long k, __m512i y0, __m512i x0, __m512i at0, __mmask16 valid) {
    if (k >= TK_K) return _mm512_setzero_ps();
    long c = k / (GA_KH * GA_KW), r = k / GA_KW % GA_KH, s = k % GA_KW;
    __m512i y = _mm512_add_epi32(y0, _mm512_set1_epi32((int)r)), x = _mm512_add_epi32(x0, _mm512_set1_epi32((int)s));
    __mmask16 in = valid & _mm512_cmpge_epi32_mask(y, _mm512_setzero_si512()) &
                   _mm512_cmplt_epi32_mask(y, _mm512_set1_epi32(GA_H)) &
                   _mm512_cmpge_epi32_mask(x, _mm512_setzero_si512()) & _mm512_cmplt_epi32_mask(x, _mm512_set1_epi32(GA_W));
    __m512i at = _mm512_add_epi32(at0, _mm512_set1_epi32((int)(r * GA_W + s)));
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), in, at, X + c * (long)GA_H * GA_W, 4);
}

/* The tile source of a convolution: columns n0 .. n0 + 15 (image, position), taps k0 .. k0 + 31 */
static void ga_conv_tile(const float *restrict X, long sk, long sn, long n0, long k0, uint16_t *restrict dst,
                         long plane) {
    (void)sk, (void)sn;
    int y0[16], x0[16], img[16];
    __mmask16 valid = 0;
    for (int l = 0; l < 16; ++l) {
        long q = n0 + l, p = q % GA_P;
        y0[l] = q < TK_N ? (int)(p / GA_OW * GA_SH - GA_PH) : 0;
        x0[l] = q < TK_N ? (int)(p % GA_OW * GA_SW - GA_PW) : 0;
        img[l] = q < TK_N ? (int)(q / GA_P * (TK_K / (GA_KH * GA_KW)) * GA_H * GA_W) : 0;
        if (q < TK_N) valid |= (__mmask16)(1u << l);
    }
    __m512i yv = _mm512_loadu_si512(y0), xv = _mm512_loadu_si512(x0);
    __m512i at0 = _mm512_add_epi32(_mm512_add_epi32(_mm512_mullo_epi32(yv, _mm512_set1_epi32(GA_W)), xv),
                                   _mm512_loadu_si512(img));
    for (long i = 0; i < 32; i += 2)
        tk_pack_pair_at(ga_conv_row(X, k0 + i, yv, xv, at0, valid), ga_conv_row(X, k0 + i + 1, yv, xv, at0, valid), dst,
                        plane, i / 2);
}
#endif

/* B's strides: B(k, n) = B[k * GA_SK + n * GA_SN] */
#define GA_SK (GA_TB ? 1 : TK_N)
#define GA_SN (GA_TB ? TK_K : 1)

static __thread float *ga_packed;

#if GA_BATCH == 1 && !GA_CONV
/* B packed once (a GEMM's weight; Kernel.prepack): a batch's or a convolution's B is its images,
 * never constant, so their kernels do not export these */
void tk_prepack(const float *restrict b, float *restrict dst) { tk_pack_b(b, GA_SK, GA_SN, (uint16_t *)dst, 1); }

void tk_run_prepacked(float *restrict out, const float *restrict a, const float *restrict b,
                      const float *restrict packed, int nthreads) {
    (void)b;
    tk_dense(a, GA_M, packed, 0, 0, out, 0, 0, 0.0f, 0, nthreads);
}
#endif

/* GA_FUSED (the generator's, direct.amx_splits_where_used): every column pair of B split where
 * it is used (tk_dense_core), never the whole packed B written and read back (where A's rows fit
 * one row block, a batch: A split once a call, and a convolution's gathered B); else (a single
 * GEMM of more rows) B packed whole first, then the blocks. */

void tk_run(float *restrict out, const float *restrict a, const float *restrict b, int nthreads) {
    if (GA_FUSED) {
        tk_dense_core(a, GA_M, 0, b, GA_SK, GA_SN, GA_BATCH, GA_BSTRIDE, 0, 0, out, 0, 0, 0.0f, 0, nthreads);
        return;
    }
    if (!ga_packed) ga_packed = tk_alloc(tk_prepacked_floats);  /* huge pages from 2 MiB (tk_alloc) */
    tk_pack_b(b, GA_SK, GA_SN, (uint16_t *)ga_packed, nthreads);  /* GA_BATCH is 1 here */
    tk_dense(a, GA_M, ga_packed, 0, 0, out, 0, 0, 0.0f, 0, nthreads);
}

#endif
