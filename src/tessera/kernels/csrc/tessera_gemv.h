/* A matrix-vector product y[n] = sum_k a[k] B(k, n) (a GEMM with one row), which streams the
 * matrix once: the GEMM loops around a micro-kernel would pack the whole matrix to use it
 * for one row. The generated file defines the sizes and includes this file:
 *
 *   GV_N, GV_K   output length, reduction length
 *   GV_TB        0: B stored [K, N] (rows of B are contiguous in n: y += a[k] * row k);
 *                1: B stored [N, K] (a Linear's weight: y[n] = dot(a, row n))
 *   GV_ROWS      rows of B per pass: k rows (TB 0) or n rows (TB 1)
 *   GV_U         vectors per pass: of y (TB 0) or of a row along k (TB 1)
 *
 *   GV_PARTS     TB 0: the k rows cut into this many contiguous parts (default 2)
 *
 * TB 0: each part of k is summed over every column, its rows in ascending order, an FMA a
 * term, and the parts' sums are added in order (part 0 + part 1 + ...); threads take parts
 * first (each streams one contiguous block of B: two threads ran 1x768x768 at 84 GFLOP/s
 * against 47 with the columns split on this Intel VM), then ranges of n within a part. TB 1:
 * threads take contiguous ranges of n (whole passes), each y[n] summed as GV_U x VL partial
 * sums added in a fixed order. Either way the order does not depend on the thread count, nor
 * do the results.
 */
#ifndef TESSERA_GEMV_H
#define TESSERA_GEMV_H

#include "tessera_vec.h"

#include <omp.h>

#define GV_CHUNK (GV_U * TK_VL)
#ifndef GV_PARTS
#define GV_PARTS 2
#endif

void tk_init(void) {}

#if GV_TB == 0
/* y[lo, hi) over k rows k0 .. k0 + kn: acc = y (or 0 on the first pass) + sum_t a[k0 + t] B[k0 + t, :] */
static void gv_pass(const float *restrict a, const float *restrict B, float *restrict y, long k0, long kn,
                    long lo, long hi, int first) {
    long c = lo;
    for (; c + GV_CHUNK <= hi; c += GV_CHUNK) {
        tk_vf acc[GV_U];
        for (int u = 0; u < GV_U; ++u) acc[u] = first ? tk_zero() : tk_load(y + c + u * TK_VL);
        if (kn == GV_ROWS) {
            TK_UNROLL_ALL
            for (int t = 0; t < GV_ROWS; ++t) {
                tk_vf at = tk_set1(a[k0 + t]);
                const float *row = B + (k0 + t) * (long)GV_N + c;
                for (int u = 0; u < GV_U; ++u) acc[u] = tk_fma(at, tk_load(row + u * TK_VL), acc[u]);
            }
        } else {
            for (long t = 0; t < kn; ++t) {
                tk_vf at = tk_set1(a[k0 + t]);
                const float *row = B + (k0 + t) * (long)GV_N + c;
                for (int u = 0; u < GV_U; ++u) acc[u] = tk_fma(at, tk_load(row + u * TK_VL), acc[u]);
            }
        }
        for (int u = 0; u < GV_U; ++u) tk_store(y + c + u * TK_VL, acc[u]);
    }
    for (; c < hi; ++c) {  /* the tail: the same FMA chain, one column at a time */
        float acc = first ? 0.0f : y[c];
        for (long t = 0; t < kn; ++t) acc = __builtin_fmaf(a[k0 + t], B[(k0 + t) * (long)GV_N + c], acc);
        y[c] = acc;
    }
}

/* y[lo, hi) = sum over the rows kb .. ke of B, in ascending order */
static void gv_range_k(const float *restrict a, const float *restrict B, float *restrict y, long kb, long ke,
                       long lo, long hi) {
    if (kb >= ke) {  /* an empty part (K < GV_PARTS) adds nothing */
        for (long n = lo; n < hi; ++n) y[n] = 0.0f;
        return;
    }
    for (long k0 = kb; k0 < ke; k0 += GV_ROWS) gv_pass(a, B, y, k0, tk_min(GV_ROWS, ke - k0), lo, hi, k0 == kb);
}
#else
/* y[n] for n in [lo, hi): GV_ROWS rows at a time, each summed as GV_U vector partial sums. */
static float gv_hsum(tk_vf v) {
    float t[TK_VL] __attribute__((aligned(64)));
    tk_store(t, v);
    float s = 0.0f;
    for (int i = 0; i < TK_VL; ++i) s += t[i];
    return s;
}

static void gv_rows(const float *restrict a, const float *restrict B, float *restrict y, long n0, long rows) {
    tk_vf acc[GV_ROWS][GV_U];
    for (int i = 0; i < GV_ROWS; ++i)
        for (int u = 0; u < GV_U; ++u) acc[i][u] = tk_zero();
    long k = 0;
    for (; k + GV_CHUNK <= GV_K; k += GV_CHUNK) {
        tk_vf av[GV_U];
        for (int u = 0; u < GV_U; ++u) av[u] = tk_load(a + k + u * TK_VL);
        for (int i = 0; i < GV_ROWS; ++i) {
            if (i >= rows) break;
            const float *row = B + (n0 + i) * (long)GV_K + k;
            for (int u = 0; u < GV_U; ++u) acc[i][u] = tk_fma(av[u], tk_load(row + u * TK_VL), acc[i][u]);
        }
    }
    for (int i = 0; i < rows; ++i) {
        tk_vf v = acc[i][0];
        for (int u = 1; u < GV_U; ++u) v = tk_add(v, acc[i][u]);
        float s = gv_hsum(v);
        const float *row = B + (n0 + i) * (long)GV_K;
        for (long kk = k; kk < GV_K; ++kk) s = __builtin_fmaf(a[kk], row[kk], s);
        y[n0 + i] = s;
    }
}

static void gv_range(const float *restrict a, const float *restrict B, float *restrict y, long lo, long hi) {
    for (long n = lo; n < hi; n += GV_ROWS) gv_rows(a, B, y, n, tk_min(GV_ROWS, hi - n));
}
#endif

/* in0: the vector a [K] (stored [1, K] or [K, 1]); in1: the matrix B. */
#if GV_TB == 0
/* B stored [K, N]: the rows are cut into GV_PARTS parts of k, each summed over every column
 * into a partial y of its own (a part is one contiguous block of B: a thread streams it), then
 * y = part 0 + part 1 + ... in that order. The parts are fixed by the schedule, not by the
 * thread count: one thread sums the same parts one after the other, so results do not depend
 * on it. Threads beyond the parts split the columns of each part. */
void tk_run(float *restrict out, const float *restrict in0, const float *restrict in1, int nthreads) {
    const long units = (GV_N + GV_CHUNK - 1) / GV_CHUNK;
    if (nthreads > GV_PARTS * units) nthreads = (int)(GV_PARTS * units);
    if (nthreads < 1) nthreads = 1;
    float *part = GV_PARTS > 1 ? tk_alloc((GV_PARTS - 1) * (long)GV_N) : 0;
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* thread t: parts p = t mod P (stepping by the threads' count per part), columns of its group */
        int per = nt >= GV_PARTS ? nt / GV_PARTS : 1, groups = nt >= GV_PARTS ? GV_PARTS : nt;
        if (t < per * groups) {
            int g = t % groups, c = t / groups;
            long lo = units * c / per * GV_CHUNK, hi = units * (c + 1) / per * GV_CHUNK;
            if (hi > GV_N) hi = GV_N;
            for (int p = g; p < GV_PARTS; p += groups) {
                float *y = p ? part + (p - 1) * (long)GV_N : out;
                if (lo < hi) gv_range_k(in0, in1, y, GV_K * p / GV_PARTS, GV_K * (p + 1) / GV_PARTS, lo, hi);
            }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (long c = 0; c < units; ++c) {  /* y = part 0 + part 1 + ..., the same order everywhere */
            long lo = c * GV_CHUNK, hi = tk_min(GV_N, lo + GV_CHUNK);
            for (int p = 1; p < GV_PARTS; ++p)
                for (long n = lo; n < hi; ++n) out[n] += part[(p - 1) * (long)GV_N + n];
        }
    }
    free(part);
}
#else
void tk_run(float *restrict out, const float *restrict in0, const float *restrict in1, int nthreads) {
    const long units = (GV_N + GV_ROWS - 1) / GV_ROWS;  /* a thread's range is whole passes */
    if (nthreads > units) nthreads = (int)units;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long lo = units * t / nt * GV_ROWS, hi = units * (t + 1) / nt * GV_ROWS;
        if (hi > GV_N) hi = GV_N;
        if (lo < hi) gv_range(in0, in1, out, lo, hi);
    }
}
#endif

#endif /* TESSERA_GEMV_H */
