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
 * channel, then scatters the valid columns. Sums run over k in order whatever the thread
 * count: results do not depend on it.
 */
#ifndef TESSERA_FLATCONV_H
#define TESSERA_FLATCONV_H

#include "tessera_vec.h"

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
#define FC_QB ((FC_Q + FC_NR - 1) / FC_NR)
#define FC_READ ((long)FC_QB * FC_NR + ((FC_KH - 1) / FC_SH) * FC_WQ + (FC_KW - 1) / FC_SW)
#define FC_PLANE ((long)FC_HQ * FC_WQ > FC_READ ? (long)FC_HQ * FC_WQ : FC_READ)
#define FC_CH ((long)FC_SH * FC_SW * FC_PLANE)
#define FC_GROUP ((long)FC_CIG * FC_CH)
#define FC_ITEMS ((long)FC_N * FC_G * FC_QB)

#if FC_COG % FC_MR != 0
#error "FC_MR must divide the output channels of a group"
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

/* The planes, grown once and kept by the calling thread (a fresh buffer of several MiB costs a
 * page fault per 4 KiB on every call); its padding is zeroed when it is allocated. */
static __thread float *fc_planes;

/* in0: the weight [G, COG, CIG, KH, KW]; in1: the input [N, G, CIG, H, W]. */
void tk_run(float *restrict out, const float *restrict in0, const float *restrict in1, int nthreads) {
    if (!fc_planes) {
        fc_planes = tk_alloc((long)FC_N * FC_G * FC_GROUP);
        memset(fc_planes, 0, (size_t)FC_N * FC_G * FC_GROUP * sizeof(float));
    }
    float *planes = fc_planes;
    const long channels = (long)FC_N * FC_G * FC_CIG;
    if (nthreads > FC_ITEMS) nthreads = (int)FC_ITEMS;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (long c = 0; c < channels; ++c) fc_fill(planes + c * FC_CH, in1 + c * (long)FC_H * FC_W);
        float *cbuf = tk_alloc((long)FC_COG * FC_NR);
        long dst[FC_NR];
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
            for (long j = 0; j < FC_NR; ++j) {
                long q = q0 + j, oh = q / FC_WQ, ow = q % FC_WQ;
                dst[j] = (oh < FC_OH && ow < FC_OW) ? oh * FC_OW + ow : -1;
            }
            float *y = out + ng * (long)FC_COG * FC_OH * FC_OW;
            for (long co = 0; co < FC_COG; ++co) {
                const float *c = cbuf + co * FC_NR;
                float *yc = y + co * (long)FC_OH * FC_OW;
                for (long j = 0; j < FC_NR; ++j)
                    if (dst[j] >= 0) yc[dst[j]] = c[j];
            }
        }
        free(cbuf);
    }
}

#endif /* TESSERA_FLATCONV_H */
