/* The vector types and intrinsics every Tessera kernel is written in, chosen by TK_VEC:
 * 256 (AVX2 + FMA, 8 floats a register) or 512 (AVX-512F, 16 floats). */
#ifndef TESSERA_VEC_H
#define TESSERA_VEC_H

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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

/* 64-byte aligned scratch (packed blocks); sizes rounded up as aligned_alloc requires. From
 * TK_HUGE_BYTES on, aligned to and rounded up to a huge page and asked for on huge pages
 * (madvise: transparent huge pages are opt-in on many machines): the kernels walk large packed
 * buffers in blocks far apart (the AMX GEMM's per-call packed B at 2048^3 ran 1.1x slower on
 * 4 KiB pages). */
#define TK_HUGE_BYTES ((size_t)1 << 21)
static float *tk_alloc(long floats) {
    size_t bytes = ((size_t)floats * sizeof(float) + 63) & ~(size_t)63;
    if (bytes < TK_HUGE_BYTES) return (float *)aligned_alloc(64, bytes ? bytes : 64);
    bytes = (bytes + TK_HUGE_BYTES - 1) & ~(TK_HUGE_BYTES - 1);
    float *p = (float *)aligned_alloc(TK_HUGE_BYTES, bytes);
    if (p) madvise(p, bytes, MADV_HUGEPAGE);
    return p;
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

#if TK_VEC == 512
/* Lanes 2i (evens) or 2i + 1 (odds) of two 16-float vectors a | b, in order. */
TK_INLINE __m512 tk_evens(__m512 a, __m512 b) {
    return _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), b);
}
TK_INLINE __m512 tk_odds(__m512 a, __m512 b) {
    return _mm512_permutex2var_ps(a, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), b);
}
#endif

/* dst[c * ds + r] = src[r * ss + c] for r < rows, c < cols (a transposed copy). AVX-512 takes
 * 16 x 16 blocks (partial ones through masks) in four butterfly stages: at distance d, rows i
 * and i + d trade their off-diagonal d-wide blocks (one two-source permute each), which after
 * d = 8, 4, 2, 1 leaves every row a column. AVX2 takes whole 8 x 8 blocks (unpack, shuffle,
 * swap of 128-bit halves) and the edges one element at a time (element by element everywhere,
 * it cost a plain call of n1 c512->512 7x7 3x3 a fifth of its time in the weight's transposition,
 * Milan, 1 thread). Not inlined: its
 * eight permute indices would otherwise sit in vector registers around the caller's hot loop
 * (a 14 x 2 convolution tile then spilled its accumulators). */
static __attribute__((noinline, unused)) void tk_transpose(float *restrict dst, long ds, const float *restrict src, long ss, long rows, long cols) {
#if TK_VEC == 512
    const __m512i lo8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                  hi8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31),
                  lo4 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                  hi4 = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31),
                  lo2 = _mm512_setr_epi32(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                  hi2 = _mm512_setr_epi32(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31),
                  lo1 = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                  hi1 = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    for (long r0 = 0; r0 < rows; r0 += 16) {
        long nr = rows - r0 < 16 ? rows - r0 : 16;
        for (long c0 = 0; c0 < cols; c0 += 16) {
            long nc = cols - c0 < 16 ? cols - c0 : 16;
            __mmask16 cm = (__mmask16)(nc == 16 ? 0xFFFFu : (1u << nc) - 1u), rm = (__mmask16)(nr == 16 ? 0xFFFFu : (1u << nr) - 1u);
            __m512 v[16], t[16];
            for (int i = 0; i < 16; ++i) v[i] = i < nr ? _mm512_maskz_loadu_ps(cm, src + (r0 + i) * ss + c0) : _mm512_setzero_ps();
#define TK_STAGE(d, lo, hi, from, to)                                                      \
            for (int i = 0; i < 16; ++i)                                                   \
                if (!(i & d)) {                                                            \
                    to[i] = _mm512_permutex2var_ps(from[i], lo, from[i + d]);              \
                    to[i + d] = _mm512_permutex2var_ps(from[i], hi, from[i + d]);          \
                }
            TK_STAGE(8, lo8, hi8, v, t)
            TK_STAGE(4, lo4, hi4, t, v)
            TK_STAGE(2, lo2, hi2, v, t)
            TK_STAGE(1, lo1, hi1, t, v)
#undef TK_STAGE
            for (int c = 0; c < nc; ++c) _mm512_mask_storeu_ps(dst + (c0 + c) * ds + r0, rm, v[c]);
        }
    }
#else
    /* whole 8 x 8 blocks in registers (unpack, shuffle, then swap the 128-bit halves); the
     * edges one element at a time */
    long r8 = rows & ~7L, c8 = cols & ~7L;
    for (long r0 = 0; r0 < r8; r0 += 8)
        for (long c0 = 0; c0 < c8; c0 += 8) {
            const float *s0 = src + r0 * ss + c0;
            __m256 a0 = _mm256_loadu_ps(s0), a1 = _mm256_loadu_ps(s0 + ss), a2 = _mm256_loadu_ps(s0 + 2 * ss),
                   a3 = _mm256_loadu_ps(s0 + 3 * ss), a4 = _mm256_loadu_ps(s0 + 4 * ss), a5 = _mm256_loadu_ps(s0 + 5 * ss),
                   a6 = _mm256_loadu_ps(s0 + 6 * ss), a7 = _mm256_loadu_ps(s0 + 7 * ss);
            __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1), t2 = _mm256_unpacklo_ps(a2, a3),
                   t3 = _mm256_unpackhi_ps(a2, a3), t4 = _mm256_unpacklo_ps(a4, a5), t5 = _mm256_unpackhi_ps(a4, a5),
                   t6 = _mm256_unpacklo_ps(a6, a7), t7 = _mm256_unpackhi_ps(a6, a7);
            __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                   u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                   u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                   u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float *d0 = dst + c0 * ds + r0;
            _mm256_storeu_ps(d0, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(d0 + ds, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(d0 + 2 * ds, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(d0 + 3 * ds, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(d0 + 4 * ds, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(d0 + 5 * ds, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(d0 + 6 * ds, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(d0 + 7 * ds, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
    for (long r = 0; r < rows; ++r)
        for (long c = r < r8 ? c8 : 0; c < cols; ++c) dst[c * ds + r] = src[r * ss + c];
#endif
}

/* d[i] = s[2 i], i < n (a stride-2 run); the vector loop reads s[2 i + 31] only while it is
 * below s[2 (n - 1)]. */
TK_INLINE void tk_copy_run2(float *restrict d, const float *restrict s, long n) {
    long i = 0;
#if TK_VEC == 512
    for (; i + 17 <= n; i += 16) _mm512_storeu_ps(d + i, tk_evens(_mm512_loadu_ps(s + 2 * i), _mm512_loadu_ps(s + 2 * i + 16)));
    if (i < n) {  /* the rest, 1-16 (a convolution's output row, often 7-28 wide): masked, only s[2i..2n-2] read */
        long m = 2 * (n - i) - 1;  /* source elements, 1..31 */
        __mmask16 lo = (__mmask16)(m >= 16 ? 0xFFFFu : (1u << m) - 1u);
        __mmask16 hi = (__mmask16)(m > 16 ? (1u << (m - 16)) - 1u : 0u);
        __m512 v = tk_evens(_mm512_maskz_loadu_ps(lo, s + 2 * i), _mm512_maskz_loadu_ps(hi, s + 2 * i + 16));
        _mm512_mask_storeu_ps(d + i, (__mmask16)((1u << (n - i)) - 1u), v);
        return;
    }
#endif
    for (; i < n; ++i) d[i] = s[2 * i];
}

/* Split row[0..n) by column parity into two phases: padded column pad + w goes to phase
 * (pad + w) % 2 at position (pad + w) / 2 of `phase0` / `phase1` (a stride-2 kernel's input
 * plane, so that every tap of neighbouring outputs is one contiguous load). AVX-512 moves 32
 * columns with two loads, two two-source permutes and two stores; the tail is scalar. */
TK_INLINE void tk_split2(float *restrict phase0, float *restrict phase1, const float *restrict row, long n, long pad) {
    long w = 0;
#if TK_VEC == 512
    float *first = (pad % 2) ? phase1 : phase0, *second = (pad % 2) ? phase0 : phase1;
    for (; w + 32 <= n; w += 32) {
        __m512 a = _mm512_loadu_ps(row + w), b = _mm512_loadu_ps(row + w + 16);
        _mm512_storeu_ps(first + (pad + w) / 2, tk_evens(a, b));
        _mm512_storeu_ps(second + (pad + w + 1) / 2, tk_odds(a, b));
    }
#endif
    for (; w < n; ++w) {
        long j = pad + w;
        (j % 2 ? phase1 : phase0)[j / 2] = row[w];
    }
}

#endif /* TESSERA_VEC_H */
