/* A depthwise convolution (one input and one output channel a group) with the channels on the
 * vector lanes: oneDNN's blocked layout (nChw16c) for the small planes of a network's last
 * stages, where a row of 7 or 14 outputs leaves most of a vector's lanes idle in
 * tessera_depthwise.h (positions on the lanes). The generated file defines the sizes and
 * includes this file:
 *
 *   DC_N, DC_C           images, channels (= groups)
 *   DC_H, DC_W           input plane;  DC_OH, DC_OW  output plane
 *   DC_KH, DC_KW         kernel;  DC_SH, DC_SW  stride;  DC_PH, DC_PW  zero padding
 *   DC_RB                register block: output positions of a row summed together
 *
 * Work items: (block of TK_VL channels, image). Each thread copies the block's input planes,
 * transposed, into a zero-padded buffer of its own laid out [row][column][lane], and the
 * block's weights into [tap][lane] (once while it stays on the block: the static schedule
 * gives a thread consecutive items), so the input under any tap of any output is one aligned
 * vector load at any stride. A block of DC_RB outputs of a row is summed in registers: for
 * each kernel row, its DC_KW weight vectors are loaded once, then each input column the block
 * reads is loaded once and added to every output whose window holds it. The sums go to a
 * [position][lane] buffer that is transposed into the output's channel planes (16 x 16
 * register transposes on AVX-512). A row's last block overlaps the one before it rather than
 * running short: the same sums, so the same values. Every output sums its taps (r, s) in
 * order from zero, one FMA each, as tessera_depthwise.h does: the two kernels give the same
 * bits, and the thread count changes nothing. Lanes past the last channel (C not a multiple
 * of TK_VL) hold whatever the buffers held and are never stored.
 */
#ifndef TESSERA_DWCHAN_H
#define TESSERA_DWCHAN_H

#include "tessera_vec.h"

#define DC_CB ((DC_C + TK_VL - 1) / TK_VL)
#define DC_ITEMS ((long)DC_N * DC_CB)
#define DC_HP (((DC_OH - 1) * DC_SH + DC_KH) > (DC_PH + DC_H) ? ((DC_OH - 1) * DC_SH + DC_KH) : (DC_PH + DC_H))
#define DC_WP (((DC_OW - 1) * DC_SW + DC_KW) > (DC_PW + DC_W) ? ((DC_OW - 1) * DC_SW + DC_KW) : (DC_PW + DC_W))
#define DC_SPAN ((DC_RB - 1) * DC_SW + DC_KW) /* input columns a block reads */

void tk_init(void) {}

/* the DC_RB outputs of row oh from column ow0, into o ([position][lane], the row's first) */
TK_INLINE void dc_block(const float *restrict plane, const float *restrict wt, float *restrict o, long oh, long ow0) {
    tk_vf acc[DC_RB];
    TK_UNROLL_ALL
    for (int b = 0; b < DC_RB; ++b) acc[b] = tk_zero();
    for (int r = 0; r < DC_KH; ++r) {
        const float *row = plane + ((oh * DC_SH + r) * (long)DC_WP + ow0 * DC_SW) * TK_VL;
        tk_vf w[DC_KW];
        TK_UNROLL_ALL
        for (int s = 0; s < DC_KW; ++s) w[s] = tk_load(wt + (r * DC_KW + s) * TK_VL);
        TK_UNROLL_ALL
        for (int j = 0; j < DC_SPAN; ++j) {
            tk_vf v = tk_load(row + j * TK_VL);
            __asm__("" : "+v"(v)); /* one load, kept in a register for every output that reads it */
            TK_UNROLL_ALL
            for (int b = 0; b < DC_RB; ++b) {
                const int s = j - b * DC_SW; /* ascending in j: each output's taps in order */
                if (s >= 0 && s < DC_KW) acc[b] = tk_fma(w[s], v, acc[b]);
            }
        }
    }
    TK_UNROLL_ALL
    for (int b = 0; b < DC_RB; ++b) tk_store(o + b * TK_VL, acc[b]);
}

/* in0: the weight [C, 1, 1, KH, KW]; in1: the input [N, C, H, W]. */
void tk_run(float *restrict out, const float *restrict in0, const float *restrict in1, int nthreads) {
    if (nthreads > DC_ITEMS) nthreads = (int)DC_ITEMS;
#pragma omp parallel num_threads(nthreads)
    {
        float *plane = tk_alloc((long)DC_HP * DC_WP * TK_VL), *wt = tk_alloc((long)DC_KH * DC_KW * TK_VL);
        float *o = tk_alloc((long)DC_OH * DC_OW * TK_VL);
        memset(plane, 0, (size_t)DC_HP * DC_WP * TK_VL * sizeof(float)); /* the padding, once */
        long filled = -1;
#pragma omp for schedule(static)
        for (long item = 0; item < DC_ITEMS; ++item) {
            const long cb = item / DC_N, n = item % DC_N, c0 = cb * TK_VL;
            const long nc = DC_C - c0 < TK_VL ? DC_C - c0 : TK_VL;
            const float *x = in1 + (n * DC_C + c0) * (long)DC_H * DC_W;
            if (cb != filled) {
                tk_transpose(wt, TK_VL, in0 + c0 * (long)DC_KH * DC_KW, DC_KH * DC_KW, nc, DC_KH * DC_KW);
                filled = cb;
            }
            for (long h = 0; h < DC_H; ++h)
                tk_transpose(plane + ((DC_PH + h) * (long)DC_WP + DC_PW) * TK_VL, TK_VL, x + h * DC_W, (long)DC_H * DC_W, nc, DC_W);
            for (long oh = 0; oh < DC_OH; ++oh)
                for (long ow = 0; ow < DC_OW; ow += DC_RB) {
                    const long ow0 = ow + DC_RB <= DC_OW ? ow : DC_OW - DC_RB;
                    dc_block(plane, wt, o + (oh * DC_OW + ow0) * TK_VL, oh, ow0);
                }
            tk_transpose(out + (n * DC_C + c0) * (long)DC_OH * DC_OW, (long)DC_OH * DC_OW, o, TK_VL, (long)DC_OH * DC_OW, nc);
        }
        free(plane);
        free(wt);
        free(o);
    }
}

#endif /* TESSERA_DWCHAN_H */
