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
#endif

/* exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so n ln2 is exact
 * to float precision), exp(r) by its Taylor series to r^6 (truncation below 1.3e-7
 * relative), times 2^n built in the exponent bits. Below -87 the result is ~1e-38, where a
 * softmax weight is nothing against the row's maximum term, 1. */
TK_INLINE tk_vf tk_exp_neg(tk_vf x) {
    x = tk_max(x, tk_set1(-87.0f));
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
    tk_vi bits = tk_slli(tk_addi(tk_cvt(n), tk_set1i(127)), 23);
    return tk_mul(p, tk_asf(bits));
}

#endif /* TESSERA_MATH_H */
