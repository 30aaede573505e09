/* A depthwise or grouped convolution (few input channels per group; any channel multiplier),
 * direct: no im2col, no GEMM. The generated file defines the sizes and includes this file:
 *
 *   DW_N, DW_G, DW_COG   images, groups, output channels per group (the multiplier)
 *   DW_CIG               input channels per group (1: depthwise)
 *   DW_H, DW_W           input plane;  DW_OH, DW_OW  output plane
 *   DW_KH, DW_KW         kernel;  DW_SH, DW_SW  stride;  DW_PH, DW_PW  zero padding
 *   DW_RB, DW_U          register block: output rows x vectors along a row
 *
 * Each thread copies a group's input planes into a zero-padded buffer of its own, with the columns
 * split into DW_SW phases (padded column j lives in phase j % SW at position j / SW), so the
 * input under tap s of output columns ow..ow+VL-1 is one contiguous vector load at any
 * stride. The padding is zeroed once per thread: every plane writes the same data region.
 * A block of DW_RB output rows x DW_U vectors is summed in registers; an input vector loaded
 * once serves every output row of the block whose window covers it; the block's sums run over
 * the group's input channels before they are stored. Sums run over (c, r, s) in a fixed order
 * inside one thread: results do not depend on the thread count.
 */
#ifndef TESSERA_DEPTHWISE_H
#define TESSERA_DEPTHWISE_H

#include "tessera_vec.h"

#define DW_CHUNK (DW_U * TK_VL)
#define DW_OWV (((DW_OW + DW_CHUNK - 1) / DW_CHUNK) * DW_CHUNK)
#define DW_DATA_COLS ((DW_PW + DW_W + DW_SW - 1) / DW_SW)
#define DW_READ_COLS (DW_OWV + (DW_KW - 1) / DW_SW)
#define DW_CP ((((DW_DATA_COLS > DW_READ_COLS ? DW_DATA_COLS : DW_READ_COLS) + TK_VL - 1) / TK_VL) * TK_VL)
#define DW_OHB (((DW_OH + DW_RB - 1) / DW_RB) * DW_RB)
#define DW_READ_ROWS ((DW_OHB - 1) * DW_SH + DW_KH)
#define DW_HPB (DW_READ_ROWS > DW_PH + DW_H ? DW_READ_ROWS : DW_PH + DW_H)
#define DW_PHASE ((long)DW_HPB * DW_CP)
#define DW_QROWS ((DW_RB - 1) * DW_SH + DW_KH)
#define DW_ITEMS ((long)DW_N * DW_G * DW_COG)
#define DW_PLANE_BUF ((long)DW_SW * DW_PHASE)
#ifndef DW_CIG
#define DW_CIG 1
#endif

void tk_init(void) {}

static void dw_fill(float *restrict buf, const float *restrict x) {
    for (long h = 0; h < DW_H; ++h) {
        const float *src = x + h * DW_W;
        if (DW_SW == 1) {
            memcpy(buf + (DW_PH + h) * DW_CP + DW_PW, src, DW_W * sizeof(float));
            continue;
        }
        if (DW_SW == 2) {
            tk_split2(buf + (DW_PH + h) * DW_CP, buf + DW_PHASE + (DW_PH + h) * DW_CP, src, DW_W, DW_PW);
            continue;
        }
        for (long w = 0; w < DW_W; ++w) {
            long j = DW_PW + w;
            buf[(j % DW_SW) * DW_PHASE + (DW_PH + h) * DW_CP + j / DW_SW] = src[w];
        }
    }
}

static void dw_plane(const float *restrict buf, const float *restrict wt, float *restrict y) {
    for (long ob = 0; ob < DW_OH; ob += DW_RB) {
        for (long c0 = 0; c0 < DW_OWV; c0 += DW_CHUNK) {
            tk_vf acc[DW_RB][DW_U];
            for (int b = 0; b < DW_RB; ++b)
                for (int u = 0; u < DW_U; ++u) acc[b][u] = tk_zero();
            for (int c = 0; c < DW_CIG; ++c) {
            const float *plane = buf + c * DW_PLANE_BUF;
            const float *wc = wt + c * (DW_KH * DW_KW);
            TK_UNROLL_ALL
            for (int q = 0; q < DW_QROWS; ++q) {
                TK_UNROLL_ALL
                for (int s = 0; s < DW_KW; ++s) {
                    const float *src = plane + (s % DW_SW) * DW_PHASE + (ob * DW_SH + q) * DW_CP + c0 + s / DW_SW;
                    tk_vf v[DW_U];
                    for (int u = 0; u < DW_U; ++u) v[u] = tk_load(src + u * TK_VL);
                    TK_UNROLL_ALL
                    for (int b = 0; b < DW_RB; ++b) {
                        const int r = q - b * DW_SH;
                        if (r < 0 || r >= DW_KH) continue;
                        tk_vf w = tk_set1(wc[r * DW_KW + s]);
                        for (int u = 0; u < DW_U; ++u) acc[b][u] = tk_fma(w, v[u], acc[b][u]);
                    }
                }
            }
            }
            for (int b = 0; b < DW_RB; ++b) {
                if (ob + b >= DW_OH) break;
                float *row = y + (ob + b) * DW_OW;
                for (int u = 0; u < DW_U; ++u) {
                    long col = c0 + u * TK_VL;
                    if (col < DW_OW) tk_store_n(row + col, acc[b][u], DW_OW - col);
                }
            }
        }
    }
}

/* in0: the weight [G, COG, CIG, KH, KW]; in1: the input [N, G, CIG, H, W]. */
void tk_run(float *restrict out, const float *restrict in0, const float *restrict in1, int nthreads) {
    if (nthreads > DW_ITEMS) nthreads = (int)DW_ITEMS;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = tk_alloc(DW_CIG * DW_PLANE_BUF);
        memset(buf, 0, (size_t)DW_CIG * DW_PLANE_BUF * sizeof(float));
        long filled = -1;
#pragma omp for schedule(static)
        for (long item = 0; item < DW_ITEMS; ++item) {
            long plane = item / DW_COG, co = item % DW_COG, g = plane % DW_G;
            if (plane != filled) {  /* the group's input planes, once per thread while it stays on the group */
                for (long c = 0; c < DW_CIG; ++c)
                    dw_fill(buf + c * DW_PLANE_BUF, in1 + (plane * DW_CIG + c) * (long)DW_H * DW_W);
                filled = plane;
            }
            dw_plane(buf, in0 + (g * DW_COG + co) * (long)(DW_CIG * DW_KH * DW_KW),
                     out + item * (long)DW_OH * DW_OW);
        }
        free(buf);
    }
}

#endif /* TESSERA_DEPTHWISE_H */
