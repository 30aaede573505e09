/* Bidirectional attention over a packed batch of variable-length inputs, for serving:
 * O = softmax(scale * Q K^T) V within each input (segment) and each head, nothing across
 * inputs, no padding anywhere.
 *
 * Q, K, V and O are T x (H * D) row-major with their own row strides (the layout a
 * projection's output has before it is viewed as heads); segment s covers rows
 * offsets[s] .. offsets[s + 1]. Per (segment, head): K's head is packed transposed (D x n,
 * keys contiguous), then for each block of query rows the scores are computed on a register
 * tile (rows x 2 vectors of keys, broadcast Q times FMA), the softmax runs on the block's
 * rows in vector registers with an exp of our own (below), and P V is accumulated on a
 * second register tile (rows x D) before the rows are divided by their sums and stored.
 *
 * Defined by the generator before this file: TK_VEC (256 or 512) and TK_D (the head size,
 * a multiple of the vector length). Reductions run in a fixed order whatever the thread
 * count (threads split (segment, head) pairs).
 */
#define TK_NG 0
#define TK_MR 8
#define TK_NR (2 * (TK_VEC / 32))
#define TK_UNROLL 1
#include "tessera_primitives.h"
#include "tessera_math.h"

#include <math.h>

#define TK_KW TK_NR                                /* keys per score panel: two vectors */
#define TK_DV (TK_D / TK_VL)                       /* vectors per head row */
#define TK_SR (TK_VEC == 512 ? 12 : 4)             /* query rows per score tile */
#define TK_ACC (TK_VEC == 512 ? 24 : 12)           /* accumulators the P V tile may use */
#define TK_PR_RAW (TK_ACC / TK_DV)
#define TK_PR (TK_PR_RAW < 1 ? 1 : (TK_PR_RAW > TK_SR ? TK_SR : TK_PR_RAW)) /* rows per P V tile */

#if TK_D % TK_VL != 0
#error "TK_D must be a multiple of the vector length"
#endif

void tk_init(void) {}

/* One (segment, head): rows a .. a + n of column block h. Kt: npad x D scratch (K packed
 * panel by panel: KW keys x D, d-major inside a panel, so a panel streams in order), S: SR x npad. */
static void tk_attend(const float *restrict Q, const float *restrict K, const float *restrict V,
                      float *restrict O, long a, long n, long h, long ldq, long ldk, long ldv, long ldo,
                      float scale, float *restrict Kt, float *restrict Vp, float *restrict S, long npad) {
    long panels = (n + TK_KW - 1) / TK_KW, width = panels * TK_KW;
    /* K's head transposed panel by panel (16 x 16 register transposes), times the scale once;
     * a last panel's keys past n are zeros. One key at a time, this packing took ~6% of a head. */
    for (long p = 0; p < panels; ++p) {
        float *dst = Kt + p * TK_D * TK_KW;
        long keys = tk_min(TK_KW, n - p * TK_KW);
        if (keys < TK_KW)
            for (long i = 0; i < TK_D * TK_KW; i += TK_VL) tk_store(dst + i, tk_zero());
        tk_transpose(dst, TK_KW, K + (a + p * TK_KW) * ldk + h * TK_D, ldk, keys, TK_D);
        for (long i = 0; i < TK_D * TK_KW; i += TK_VL) tk_store(dst + i, tk_mul(tk_load(dst + i), tk_set1(scale)));
    }
    /* V's head copied contiguous: read in place, its rows (a fused projection's, 3 H D floats
     * apart) fall into a few of L1's sets and were fetched again for every block of queries */
    for (long j = 0; j < n; ++j)
        for (int v = 0; v < TK_DV; ++v) tk_store(Vp + j * TK_D + v * TK_VL, tk_load(V + (a + j) * ldv + h * TK_D + v * TK_VL));
    for (long i0 = 0; i0 < n; i0 += TK_SR) {
        long mr = tk_min(TK_SR, n - i0);
        const float *qr[TK_SR];
        for (int i = 0; i < TK_SR; ++i) qr[i] = Q + (a + i0 + (i < mr ? i : 0)) * ldq + h * TK_D;
        /* scores: S[i, j] = scale * q_i . k_j, a tile of SR rows x KW keys at a time */
        for (long p = 0; p < panels; ++p) {
            tk_vf acc[TK_SR][2];
            for (int i = 0; i < TK_SR; ++i) acc[i][0] = acc[i][1] = tk_zero();
            const float *kt = Kt + p * TK_D * TK_KW;
            for (long d = 0; d < TK_D; ++d) {
                tk_vf b0 = tk_load(kt + d * TK_KW), b1 = tk_load(kt + d * TK_KW + TK_VL);
                for (int i = 0; i < TK_SR; ++i) {
                    tk_vf qv = tk_set1(qr[i][d]);
                    acc[i][0] = tk_fma(qv, b0, acc[i][0]);
                    acc[i][1] = tk_fma(qv, b1, acc[i][1]);
                }
            }
            for (int i = 0; i < TK_SR; ++i) {
                tk_store(S + i * npad + p * TK_KW, acc[i][0]);
                tk_store(S + i * npad + p * TK_KW + TK_VL, acc[i][1]);
            }
        }
        /* softmax of each row over its n keys (the padded keys past n read as -inf); the rows'
         * maxima first, all rows a key vector at a time: one row's running max alone waits on
         * its last max at every vector */
        float inv[TK_SR];
        tk_vf rmax[TK_SR];
        for (int i = 0; i < TK_SR; ++i) {
            for (long j = n; j < width; ++j) S[i * npad + j] = -INFINITY;
            rmax[i] = tk_set1(-INFINITY);
        }
        for (long j = 0; j < width; j += TK_VL)
            for (int i = 0; i < TK_SR; ++i) rmax[i] = tk_max(rmax[i], tk_load(S + i * npad + j));
        for (int i = 0; i < TK_SR; ++i) {
            float *s = S + i * npad;
            /* exp(s - max) = 2^((s - max) log2 e), the shift and the product one FMA */
            tk_vf l2e = tk_set1(1.44269504088896341f), shift = tk_set1(-tk_hmax(rmax[i]) * 1.44269504088896341f), sum = tk_zero();
            for (long j = 0; j < width; j += TK_VL) {
                tk_vf e = tk_exp2_neg(tk_fma(tk_load(s + j), l2e, shift));
                tk_store(s + j, e);
                sum = tk_add(sum, e);
            }
            inv[i] = 1.0f / tk_hsum(sum);
        }
        /* O rows = P V / sums, PR rows x D at a time */
        for (int i1 = 0; i1 < mr; i1 += TK_PR) {
            tk_vf acc[TK_PR][TK_DV];
            for (int i = 0; i < TK_PR; ++i)
                for (int v = 0; v < TK_DV; ++v) acc[i][v] = tk_zero();
            for (long j = 0; j < n; ++j) {
                const float *vr = Vp + j * TK_D;
                tk_vf vv[TK_DV];
                for (int v = 0; v < TK_DV; ++v) vv[v] = tk_load(vr + v * TK_VL);
                for (int i = 0; i < TK_PR; ++i) {
                    tk_vf pv = tk_set1(S[(i1 + i < TK_SR ? i1 + i : 0) * npad + j]);
                    for (int v = 0; v < TK_DV; ++v) acc[i][v] = tk_fma(pv, vv[v], acc[i][v]);
                }
            }
            for (int i = 0; i < TK_PR && i1 + i < mr; ++i) {
                float *orow = O + (a + i0 + i1 + i) * ldo + h * TK_D;
                tk_vf sv = tk_set1(inv[i1 + i]);
                for (int v = 0; v < TK_DV; ++v) tk_store(orow + v * TK_VL, tk_mul(acc[i][v], sv));
            }
        }
    }
}

void tk_attention(const float *Q, const float *K, const float *V, float *O, const long *offsets,
                  long segments, long heads, long ldq, long ldk, long ldv, long ldo, float scale,
                  int nthreads) {
    long longest = 0;
    for (long s = 0; s < segments; ++s)
        if (offsets[s + 1] - offsets[s] > longest) longest = offsets[s + 1] - offsets[s];
    long npad = (longest + TK_KW - 1) / TK_KW * TK_KW;
    if (npad == 0) return;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *Kt = tk_alloc((long)TK_D * npad), *Vp = tk_alloc((long)TK_D * npad), *S = tk_alloc((long)TK_SR * npad);
#pragma omp for schedule(dynamic)
        for (long w = 0; w < segments * heads; ++w) {
            long s = w / heads, h = w % heads, a = offsets[s], n = offsets[s + 1] - a;
            if (n > 0) tk_attend(Q, K, V, O, a, n, h, ldq, ldk, ldv, ldo, scale, Kt, Vp, S, npad);
        }
        free(Kt);
        free(Vp);
        free(S);
    }
}
