/* Vector math shared by the serving kernels (attention's softmax, the dense layer's GELU):
 * the float and integer intrinsics they need beyond tessera_vec.h, and exp for x <= 0.
 * Include after tessera_vec.h (TK_VEC chosen). */
#ifndef TESSERA_MATH_H
#define TESSERA_MATH_H

#include "tessera_vec.h"

#if TK_VEC == 512
typedef __m512i tk_vi;
#define tk_max _mm512_max_ps
#define tk_mul _mm512_mul_ps
#define tk_div _mm512_div_ps
#define tk_round(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define tk_cvt _mm512_cvtps_epi32
#define tk_addi _mm512_add_epi32
#define tk_andi _mm512_and_si512
#define tk_set1i _mm512_set1_epi32
#define tk_slli _mm512_slli_epi32
#define tk_asf _mm512_castsi512_ps
#define tk_asi _mm512_castps_si512
/* where z < 0, neg, else pos */
#define tk_select_neg(z, neg, pos) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((z), _mm512_setzero_ps(), _CMP_LT_OQ), (pos), (neg))
#define tk_rcp_approx _mm512_rcp14_ps /* relative error below 2^-14 */
#else
typedef __m256i tk_vi;
#define tk_max _mm256_max_ps
#define tk_mul _mm256_mul_ps
#define tk_div _mm256_div_ps
#define tk_round(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define tk_cvt _mm256_cvtps_epi32
#define tk_addi _mm256_add_epi32
#define tk_andi _mm256_and_si256
#define tk_set1i _mm256_set1_epi32
#define tk_slli _mm256_slli_epi32
#define tk_asf _mm256_castsi256_ps
#define tk_asi _mm256_castps_si256
#define tk_select_neg(z, neg, pos) _mm256_blendv_ps((pos), (neg), _mm256_cmp_ps((z), _mm256_setzero_ps(), _CMP_LT_OQ))
#define tk_rcp_approx _mm256_rcp_ps /* relative error below 1.5 * 2^-12 */
#endif

/* 1 / d for d >= 1: the hardware's estimate and one Newton step, e (2 - d e), which squares
 * its relative error (2^-24 after rcp14; ~2^-22 after AVX's rcp, a few float32 ulp). A vector
 * divide costs ~10 cycles of throughput where these three cost ~1.5. */
TK_INLINE tk_vf tk_recip(tk_vf d) {
    tk_vf e = tk_rcp_approx(d);
    return tk_mul(e, tk_fma(tk_mul(d, tk_set1(-1.0f)), e, tk_set1(2.0f)));
}

/* p 2^n for an integer-valued n in the normal exponent range (AVX-512's scalef in one
 * instruction, else n built into a float's exponent bits). */
TK_INLINE tk_vf tk_times_2n(tk_vf p, tk_vf n) {
#if TK_VEC == 512
    return _mm512_scalef_ps(p, n);
#else
    tk_vi bits = tk_slli(tk_addi(tk_cvt(n), tk_set1i(127)), 23);
    return tk_mul(p, tk_asf(bits));
#endif
}

/* exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so n ln2 is exact
 * to float precision), exp(r) by its Taylor series to r^6 (truncation below 1.3e-7
 * relative), times 2^n (AVX-512's scalef, else built in the exponent bits). Below -80 the
 * result is held at exp(-80) ~ 1.8e-35: a normal float with room below it, so a product of it
 * with factors down to ~1e-3 (GELU's t P(t) x / 2) stays normal too; a subnormal value costs a
 * microcode assist in every operation that touches it. */
TK_INLINE tk_vf tk_exp_neg(tk_vf x) {
    x = tk_max(x, tk_set1(-80.0f));
    tk_vf n = tk_round(tk_mul(x, tk_set1(1.44269504088896341f)));
    tk_vf r = tk_fma(n, tk_set1(-0.693145751953125f), x);
    r = tk_fma(n, tk_set1(-1.42860682030941723212e-6f), r);
    tk_vf p = tk_set1(1.0f / 720.0f);
    p = tk_fma(p, r, tk_set1(1.0f / 120.0f));
    p = tk_fma(p, r, tk_set1(1.0f / 24.0f));
    p = tk_fma(p, r, tk_set1(1.0f / 6.0f));
    p = tk_fma(p, r, tk_set1(0.5f));
    p = tk_fma(p, r, tk_set1(1.0f));
    p = tk_fma(p, r, tk_set1(1.0f));
    return tk_times_2n(p, n);
}

/* 2^t for t <= 0, clamped at -125 (2^-125 ~ 2.4e-38 stays a normal float: a softmax weight
 * that far below the row's maximum term, 1, is nothing against it): t = n + f with n an
 * integer and |f| <= 1/2, 2^f = exp(f ln2) by its Taylor series to (f ln2)^6 (truncation
 * below 1.3e-7 relative), times 2^n. Two operations fewer than tk_exp_neg on a softmax's
 * (s - max) log2(e), whose product and shift are one FMA. */
TK_INLINE tk_vf tk_exp2_neg(tk_vf t) {
    t = tk_max(t, tk_set1(-125.0f));
    tk_vf n = tk_round(t);
    tk_vf f = tk_add(t, tk_mul(n, tk_set1(-1.0f)));  /* exact: t and n are within 1/2 */
    tk_vf p = tk_set1(1.5403530393381606e-4f);
    p = tk_fma(p, f, tk_set1(1.3333558146428443e-3f));
    p = tk_fma(p, f, tk_set1(9.6181291076284772e-3f));
    p = tk_fma(p, f, tk_set1(5.5504108664821580e-2f));
    p = tk_fma(p, f, tk_set1(2.4022650695910071e-1f));
    p = tk_fma(p, f, tk_set1(6.9314718055994531e-1f));
    p = tk_fma(p, f, tk_set1(1.0f));
    return tk_times_2n(p, n);
}

/* A vector's largest lane and its lanes' sum (512: the library's reduction tree). */
#if TK_VEC == 512
TK_INLINE float tk_hmax(tk_vf v) { return _mm512_reduce_max_ps(v); }
TK_INLINE float tk_hsum(tk_vf v) { return _mm512_reduce_add_ps(v); }
#else
TK_INLINE float tk_hmax(tk_vf v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    float m = t[0];
    for (int i = 1; i < 8; ++i) m = t[i] > m ? t[i] : m;
    return m;
}
TK_INLINE float tk_hsum(tk_vf v) {
    float t[8], s = 0.0f;
    _mm256_storeu_ps(t, v);
    for (int i = 0; i < 8; ++i) s += t[i];
    return s;
}
#endif

#endif /* TESSERA_MATH_H */
