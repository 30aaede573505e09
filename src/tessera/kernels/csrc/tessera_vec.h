/* The vector types and intrinsics every Tessera kernel is written in, chosen by TK_VEC:
 * 256 (AVX2 + FMA, 8 floats a register) or 512 (AVX-512F, 16 floats). */
#ifndef TESSERA_VEC_H
#define TESSERA_VEC_H

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#if TK_VEC == 512
typedef __m512 tk_vf;
#define TK_VL 16
#define tk_load _mm512_loadu_ps
#define tk_store _mm512_storeu_ps
#define tk_set1 _mm512_set1_ps
#define tk_zero _mm512_setzero_ps
#define tk_fma _mm512_fmadd_ps
#define tk_add _mm512_add_ps
#elif TK_VEC == 256
typedef __m256 tk_vf;
#define TK_VL 8
#define tk_load _mm256_loadu_ps
#define tk_store _mm256_storeu_ps
#define tk_set1 _mm256_set1_ps
#define tk_zero _mm256_setzero_ps
#define tk_fma _mm256_fmadd_ps
#define tk_add _mm256_add_ps
#else
#error "TK_VEC must be 256 or 512"
#endif

#define TK_INLINE static inline __attribute__((always_inline))
/* `#pragma GCC unroll` does not expand macros; _Pragma of a stringified argument does. */
#define TK_DO_PRAGMA(x) _Pragma(#x)
#define TK_UNROLL_LOOP(n) TK_DO_PRAGMA(GCC unroll n)

TK_INLINE long tk_min(long a, long b) { return a < b ? a : b; }

/* 64-byte aligned scratch (packed blocks); sizes rounded up as aligned_alloc requires. */
static float *tk_alloc(long floats) {
    size_t bytes = ((size_t)floats * sizeof(float) + 63) & ~(size_t)63;
    return (float *)aligned_alloc(64, bytes ? bytes : 64);
}
#define TK_UNROLL_ALL TK_DO_PRAGMA(GCC unroll 64)

/* Store the first n (0 < n <= TK_VL) lanes of v at dst (a row's tail). */
TK_INLINE void tk_store_n(float *dst, tk_vf v, long n) {
    if (n >= TK_VL) {
        tk_store(dst, v);
        return;
    }
#if TK_VEC == 512
    _mm512_mask_storeu_ps(dst, (__mmask16)((1u << n) - 1u), v);
#else
    float tmp[TK_VL] __attribute__((aligned(32)));
    tk_store(tmp, v);
    for (long i = 0; i < n; ++i) dst[i] = tmp[i];
#endif
}

#endif /* TESSERA_VEC_H */
