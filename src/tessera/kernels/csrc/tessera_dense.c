/* A dense layer, Y[M, N] = X[M, K] W[N, K]^T + bias (+ R), for serving: N and K are fixed
 * when it is compiled (a model's layer), M (the tokens of a batch) is given at each call.
 *
 * The weight is packed once, when the model is loaded (tk_pack_weight), into the layout the
 * micro-kernel reads: for each KC block of K, the N columns as NR-wide panels, each k-major
 * (NR floats per k), zero-padded past N. A call reads X in place, MR rows at a time (its
 * row stride K is known when the kernel is compiled, so each row's broadcast is a fixed offset
 * from one pointer); only a last tile of fewer than MR rows is packed, zero-padded, into an
 * MR-row panel. It walks BLIS's inner loops over a block of X's rows and KC columns (panels of
 * W outside, rows of X inside, so a W micro-panel stays in L1 while the rows stream past).
 * Packing every tile of X first cost 3-6% of a call with N = 384 (a MiniLM-size request 3.0%
 * faster in place, a BERT-base-size one 3.4%: the same bits, the sums in the same order).
 * The epilogue runs on the register tile on the last KC block, before the store: bias, and the residual R when given
 * (Y = X W^T + bias + R, the sum that a post-LayerNorm encoder feeds its LayerNorm), or GELU
 * (an encoder's intermediate layer), and that LayerNorm itself, row by row, once a block of
 * rows is complete and still in cache.
 *
 * Defined by the generator before this file: TK_VEC, TK_MR, TK_NR, TK_UNROLL (see
 * tessera_primitives.h), TK_N, TK_K, TK_KC, TK_MC.
 *
 * Reductions run in one fixed order (k blocks in order, k in order inside), whatever the
 * thread count: threads split W's panels, never K.
 */
#define TK_NG 0
#include "tessera_primitives.h"
#include "tessera_math.h"
#include "tessera_dense_epilogue.h"

#define TK_NP ((TK_N + TK_NR - 1) / TK_NR)

void tk_init(void) {}

long tk_packed_floats(void) { return (long)TK_NP * TK_NR * TK_K; }

/* W: N x K row-major (torch's Linear.weight). Block pc starts at pc * NP * NR floats; panel
 * p of it at p * NR * kc further. */
void tk_pack_weight(const float *restrict W, float *restrict Wp) {
    for (long pc = 0; pc < TK_K; pc += TK_KC) {
        long kc = tk_min(TK_KC, TK_K - pc);
        float *blk = Wp + pc * TK_NP * TK_NR;
        for (long p = 0; p < TK_NP; ++p) {
            float *dst = blk + p * TK_NR * kc;
            for (long k = 0; k < kc; ++k)
                for (long j = 0; j < TK_NR; ++j) {
                    long n = p * TK_NR + j;
                    dst[k * TK_NR + j] = n < TK_N ? W[n * TK_K + pc + k] : 0.0f;
                }
        }
    }
}

/* A tail tile of X, its mr < MR rows from m0, columns pc .. pc + kc, into one MR-row panel
 * (k-major, MR floats per k), the rows past mr zeros. Full tiles are read in place. */
static void tk_pack_x_tail(const float *restrict X, long m0, long mr, long pc, long kc, float *restrict Ap) {
    for (long k = 0; k < kc; ++k)
        for (int i = 0; i < TK_MR; ++i) Ap[k * TK_MR + i] = i < mr ? X[(m0 + i) * TK_K + pc + k] : 0.0f;
}

/* One MR x NR tile of Y (row stride N): accumulate over kc, then (first block) store or add;
 * on the last block add bias and R. mr, nr: the valid part. */
TK_INLINE void tk_dense_tile(long kc, const float *restrict a, long a_rs, long a_cs, const float *restrict b, float *restrict y,
                             int first, int last, const float *restrict bias, const float *restrict r,
                             long mr, long nr, const char *pf, long npf, int gelu) {
    tk_vf acc[TK_MR][TK_NV];
    if (first)  /* the output's lines are asked for now and arrive while the FMAs run: in a model,
                 * a layer's output buffer was last written a whole forward ago, out of cache, and
                 * each store's read-for-ownership waited on memory (the MiniLM-size fused QKV call
                 * at 256 rows: 6% faster inside the model) */
        for (long i = 0; i < mr; ++i)
            for (long j = 0; j < nr; j += 16) _mm_prefetch((const char *)(y + i * TK_N + j), _MM_HINT_T0);
    tk_tile_sums_pf(kc, a, a_rs, a_cs, b, TK_NR, acc, pf, npf);
    if (mr == TK_MR && nr == TK_NR) {
        for (int i = 0; i < TK_MR; ++i) {
            float *yr = y + i * TK_N;
            for (int j = 0; j < TK_NV; ++j) {
                tk_vf v = first ? acc[i][j] : tk_add(tk_load(yr + j * TK_VL), acc[i][j]);
                if (last) {
                    v = tk_add(v, tk_load(bias + j * TK_VL));
                    if (r) v = tk_add(v, tk_load(r + i * TK_N + j * TK_VL));
                    if (gelu) v = tk_gelu(v);
                }
                tk_store(yr + j * TK_VL, v);
            }
        }
        return;
    }
    float tile[TK_MR * TK_NR] __attribute__((aligned(64)));
    for (int i = 0; i < TK_MR; ++i)
        for (int j = 0; j < TK_NV; ++j) tk_store(tile + i * TK_NR + j * TK_VL, acc[i][j]);
    for (long i = 0; i < mr; ++i)
        for (long j = 0; j < nr; ++j) {
            float v = first ? tile[i * TK_NR + j] : y[i * TK_N + j] + tile[i * TK_NR + j];
            if (last) {
                v += bias[j];
                if (r) v += r[i * TK_N + j];
            }
            tile[i * TK_NR + j] = v;
        }
    if (last && gelu)  /* the same vector GELU as a full tile's: a row's bits do not depend on the batch */
        for (int i = 0; i < TK_MR; ++i)
            for (int j = 0; j < TK_NV; ++j) tk_store(tile + i * TK_NR + j * TK_VL, tk_gelu(tk_load(tile + i * TK_NR + j * TK_VL)));
    for (long i = 0; i < mr; ++i)
        for (long j = 0; j < nr; ++j) y[i * TK_N + j] = tile[i * TK_NR + j];
}

/* The calling thread's packed tail tile of X (fewer than MR rows, zero-padded), allocated once
 * and kept (no allocation per call). */
static __thread float *tk_xbuf;

/* Y = X W^T + bias (+ R when r is not NULL), then GELU of each value when gelu is not 0, then,
 * when gamma is not NULL, LayerNorm of each row (gamma, beta, eps) while the block's rows are
 * still in cache. X: M x K, Y and R: M x N, row-major. */
void tk_dense(const float *restrict X, long M, const float *restrict Wp, const float *restrict bias,
              const float *restrict R, float *restrict Y, const float *restrict gamma,
              const float *restrict beta, float eps, int gelu, int nthreads) {
    if (!tk_xbuf) tk_xbuf = tk_alloc((long)TK_MR * TK_KC);
    float *Ap = tk_xbuf;
    /* M in blocks of near-equal rows (MR multiples), as few as hold at most MC * 5 / 4 each:
     * a block streams all of W, so 260 rows as 256 + 4 read W twice for 4 rows */
    long nblocks = (M + TK_MC * 5 / 4 - 1) / (TK_MC * 5 / 4), step = (M + nblocks - 1) / nblocks;
    step = (step + TK_MR - 1) / TK_MR * TK_MR;
    for (long ic = 0; ic < M; ic += step) {
        long mc = tk_min(step, M - ic);
        for (long pc = 0; pc < TK_K; pc += TK_KC) {
            long kc = tk_min(TK_KC, TK_K - pc);
            int first = pc == 0, last = pc + kc == TK_K;
            const float *blk = Wp + pc * TK_NP * TK_NR;
            long full = mc / TK_MR * TK_MR;  /* full row tiles read X in place; a tail is packed */
            if (full < mc) tk_pack_x_tail(X, ic + full, mc - full, pc, kc, Ap);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
            for (long p = 0; p < TK_NP; ++p) {
                long n0 = p * TK_NR, nr = tk_min(TK_NR, TK_N - n0);
                /* The next panel of W (the next block's first after the last; past the end a
                 * prefetch is dropped, never a fault) is fetched into L2 a few lines a tile:
                 * the packed weights of a whole model outgrow the caches, and the hardware
                 * prefetcher alone left ~10% of the time waiting on the first row tile. */
                const char *next = (const char *)(blk + (p + 1) * TK_NR * kc);
                long lines = TK_NR * kc / 16, tiles = (mc + TK_MR - 1) / TK_MR, npf;
                for (long ir = 0; ir < mc; ir += TK_MR) {
                    long row = ic + ir;
                    const char *pf = tk_pf_share(next, lines, tiles, ir / TK_MR, &npf);
                    /* two calls, not one with strides chosen at run time: each is inlined with
                     * its strides as constants (in place, row i's broadcast a fixed offset) */
                    if (ir < full)
                        tk_dense_tile(kc, X + row * TK_K + pc, TK_K, 1, blk + p * TK_NR * kc, Y + row * TK_N + n0, first, last,
                                      bias + n0, R ? R + row * TK_N + n0 : 0, TK_MR, nr, pf, npf, gelu);
                    else
                        tk_dense_tile(kc, Ap, 1, TK_MR, blk + p * TK_NR * kc, Y + row * TK_N + n0, first, last,
                                      bias + n0, R ? R + row * TK_N + n0 : 0, mc - ir, nr, pf, npf, gelu);
                }
            }
        }
        if (gamma) tk_layer_norm_rows(Y + ic * TK_N, mc, gamma, beta, eps);
    }
}
