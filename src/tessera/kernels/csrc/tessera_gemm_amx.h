/* The operator compiler's GEMM on AMX tiles at float32 accuracy: C[M, N] = A[M, K] B (B stored
 * [K, N], or [N, K] when GA_TB), the dense layer of tessera_amx.h with no bias and M fixed. B
 * is split into its three bfloat16 parts and laid out as tiles at each call (or once, by
 * tk_prepack, for a B that does not change: a layer's weight), A block by block inside the
 * layer. GA_BATCH products share A, each with a B and a C of its own, one after the other: a
 * 1x1 convolution of stride 1 (A its weight [C_out, C_in], B an image [C_in, H W], C the
 * image's output). The generated file defines TK_VEC (512), TK_N, TK_K, TK_KC, TK_MB, GA_M,
 * GA_TB and GA_BATCH, then includes this file.
 */
#ifndef TESSERA_GEMM_AMX_H
#define TESSERA_GEMM_AMX_H

#include "tessera_amx.h"

long tk_prepacked_floats = 3L * TK_NT * TK_KT * TK_TILE / 2;

/* B's strides: B(k, n) = B[k * GA_SK + n * GA_SN] */
#define GA_SK (GA_TB ? 1 : TK_N)
#define GA_SN (GA_TB ? TK_K : 1)

static __thread float *ga_packed;

void tk_prepack(const float *restrict b, float *restrict dst) { tk_pack_b(b, GA_SK, GA_SN, (uint16_t *)dst, 1); }

void tk_run_prepacked(float *restrict out, const float *restrict a, const float *restrict b,
                      const float *restrict packed, int nthreads) {
    (void)b;
    tk_dense(a, GA_M, packed, 0, 0, out, 0, 0, 0.0f, 0, nthreads);
}

/* Rows within one row block: each column pair of B split where it is used (tk_dense_core), never
 * the whole packed B written and read back; more rows: B packed once a call, then the blocks. */
#define GA_FUSED (GA_M <= TK_MB)

void tk_run(float *restrict out, const float *restrict a, const float *restrict b, int nthreads) {
    if (GA_FUSED) {
        for (long i = 0; i < GA_BATCH; ++i)
            tk_dense_core(a, GA_M, 0, b + i * (long)TK_K * TK_N, GA_SK, GA_SN, 0, 0, out + i * (long)GA_M * TK_N, 0, 0,
                          0.0f, 0, nthreads);
        return;
    }
    if (!ga_packed) ga_packed = tk_alloc(tk_prepacked_floats);  /* huge pages from 2 MiB (tk_alloc) */
    for (long i = 0; i < GA_BATCH; ++i) {
        tk_pack_b(b + i * (long)TK_K * TK_N, GA_SK, GA_SN, (uint16_t *)ga_packed, nthreads);
        tk_dense(a, GA_M, ga_packed, 0, 0, out + i * (long)GA_M * TK_N, 0, 0, 0.0f, 0, nthreads);
    }
}

#endif
