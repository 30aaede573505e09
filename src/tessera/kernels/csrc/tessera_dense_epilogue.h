/* The dense layers' epilogue, shared by the AVX kernel (tessera_dense.c) and the AMX one
 * (tessera_amx.h): GELU on a vector of outputs, and LayerNorm of complete rows of Y.
 * Include after tessera_math.h, with TK_N (Y's row length) defined. */
#ifndef TESSERA_DENSE_EPILOGUE_H
#define TESSERA_DENSE_EPILOGUE_H

#include <math.h>

/* GELU(x) = x Phi(x) = x / 2 (1 + erf(x / sqrt 2)), with erf(|z|) = 1 - q, q = t P(t) exp(-z^2),
 * t = 1 / (1 + p |z|) (Abramowitz and Stegun 7.1.26: |error of erf| <= 1.5e-7). For z < 0 the
 * factor 1 + erf(z) is q itself (no cancellation against 1), for z >= 0 it is 2 - q. Each lane
 * on its own: a value's result does not depend on its neighbours (nor on the tile it is in).
 * exp(-z^2) stops at exp(-80) (|x| >= 12.6; see tk_exp_neg), which keeps q and x q / 2 normal
 * floats: below it they went subnormal and every such value cost a microcode assist (a layer
 * whose outputs reached |x| ~ 20 ran its GELU 2.8x slower); GELU there is 0 or x anyway. */
TK_INLINE tk_vf tk_gelu(tk_vf x) {
    tk_vf z = tk_mul(x, tk_set1(0.707106781f));
    tk_vf az = tk_asf(tk_andi(tk_asi(z), tk_set1i(0x7fffffff)));
    tk_vf t = tk_recip(tk_fma(tk_set1(0.3275911f), az, tk_set1(1.0f)));
    tk_vf poly = tk_set1(1.061405429f);
    poly = tk_fma(poly, t, tk_set1(-1.453152027f));
    poly = tk_fma(poly, t, tk_set1(1.421413741f));
    poly = tk_fma(poly, t, tk_set1(-0.284496736f));
    poly = tk_fma(poly, t, tk_set1(0.254829592f));
    tk_vf q = tk_mul(tk_mul(poly, t), tk_exp_neg(tk_mul(tk_mul(az, az), tk_set1(-1.0f))));
    tk_vf one_plus_erf = tk_select_neg(z, q, tk_fma(q, tk_set1(-1.0f), tk_set1(2.0f)));
    return tk_mul(tk_mul(x, tk_set1(0.5f)), one_plus_erf);
}

/* The sum over a row's N values of (v - shift), or of its square when sq: four vector sums
 * side by side (a fixed order: lanes, sums 0 + 1 and 2 + 3, the lanes' tree, then the tail in
 * order), where one running sum made every add wait on the one before. */
TK_INLINE float tk_row_sum(const float *restrict row, float shift, int sq) {
    tk_vf s[4] = {tk_zero(), tk_zero(), tk_zero(), tk_zero()}, m = tk_set1(-shift);
    long j = 0;
    for (; j + 4 * TK_VL <= TK_N; j += 4 * TK_VL)
        for (int u = 0; u < 4; ++u) {
            tk_vf d = tk_add(tk_load(row + j + u * TK_VL), m);
            s[u] = sq ? tk_fma(d, d, s[u]) : tk_add(s[u], d);
        }
    for (; j + TK_VL <= TK_N; j += TK_VL) {
        tk_vf d = tk_add(tk_load(row + j), m);
        s[0] = sq ? tk_fma(d, d, s[0]) : tk_add(s[0], d);
    }
    float t = tk_hsum(tk_add(tk_add(s[0], s[1]), tk_add(s[2], s[3])));
    for (; j < TK_N; ++j) t += sq ? (row[j] - shift) * (row[j] - shift) : row[j] - shift;
    return t;
}

/* LayerNorm of rows y[0 .. rows) in place over their N values: (y - mean) / sqrt(var + eps)
 * * gamma + beta, the mean and the (biased) variance each a sum in a fixed order over the
 * row, as two passes (the second over the deviations, not over squares minus a squared mean). */
static void tk_layer_norm_rows(float *restrict y, long rows, const float *restrict gamma,
                               const float *restrict beta, float eps) {
    for (long i = 0; i < rows; ++i) {
        float *row = y + i * TK_N;
        float mean = tk_row_sum(row, 0.0f, 0) / TK_N;
        float rstd = 1.0f / sqrtf(tk_row_sum(row, mean, 1) / TK_N + eps);
        tk_vf rv = tk_set1(rstd);
        long j = 0;
        for (; j + TK_VL <= TK_N; j += TK_VL) {
            tk_vf d = tk_mul(tk_add(tk_load(row + j), tk_set1(-mean)), rv);
            tk_store(row + j, tk_fma(d, tk_load(gamma + j), tk_load(beta + j)));
        }
        for (; j < TK_N; ++j) row[j] = (row[j] - mean) * rstd * gamma[j] + beta[j];
    }
}

#endif
