/* A dense layer, Y[M, N] = X[M, K] W[N, K]^T + bias (+ R), on AMX tiles with float32 accuracy:
 * the same entry points, arguments and epilogues as tessera_dense.c (N, K fixed when compiled,
 * M given at each call), for CPUs with AMX-BF16. The serving layer (dense.py) compiles this
 * file alone; the operator compiler's AMX GEMM (tessera_gemm_amx.h) builds on it.
 *
 * AMX multiplies bfloat16 (8 significant bits) and accumulates in float32. Each float32 value
 * is split into three bfloat16 parts, x = h + m + l (h = bf16(x), m = bf16(x - h),
 * l = bf16(x - h - m); each difference is exact in float32), with |m| <= 2^-8 |x| and
 * |l| <= 2^-16 |x|, and x - h - m - l below 2^-24 |x|. A product x w then takes six bf16
 * products, hh + hm + mh + hl + lh + mm (each exact in float32), leaving out ml, lm and ll,
 * which are below 2^-23 |x w| together (Henry, Tang and Heinecke, "Leveraging the bfloat16
 * artificial intelligence datatype for higher-precision computations", 2019: "bf16x6"). The
 * sums run in float32 as in any float32 GEMM; the tests bound the error against float64 at
 * the float32 GEMM's own tolerance. One AMX tile product (16 x 16 outputs, 32 terms each)
 * runs at 16 times the AVX-512 FMA rate, so six of them still beat the FMAs.
 *
 * Layouts. The weight is packed once: each of its three parts as VNNI tiles (for a column
 * tile of 16 columns of W^T and a k tile of 32, 16 rows of 16 (k, k + 1) pairs, 1 KiB), N
 * padded to 32 columns and K to TK_KP (a multiple of 32) with zeros. X is split per call, a
 * block of TK_MB rows by TK_KC columns at a time, into three bf16 planes of tiles laid out as
 * W's are (zero padded to 32 rows). Loops: row blocks of X, k blocks, then pairs of column tiles (threads
 * split these), then pairs of row tiles; four accumulator tiles (32 x 32 outputs) take each k
 * tile's products as h.(h, m, l), m.(h, m), l.h: two tile loads of X per part and two of W per
 * product pair. Partial sums of one k block go to Y and come back for the next; on the last,
 * the epilogue (bias, residual, GELU) runs on the 32 x 32 block as it is stored, and
 * LayerNorm on the row block's complete rows.
 *
 * Reductions run in one fixed order whatever M and the thread count: a row's outputs do not
 * depend on the batch it is in.
 *
 * Defined by the generator before this file: TK_VEC (512), TK_N, TK_K, TK_KC, TK_MB.
 */
#ifndef TESSERA_AMX_H
#define TESSERA_AMX_H

#include "tessera_vec.h"
#include "tessera_math.h"
#include "tessera_dense_epilogue.h"

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TK_KP ((TK_K + 31) / 32 * 32)        /* K padded to whole k tiles */
#define TK_KCP ((TK_KC + 31) / 32 * 32)      /* a k block, whole k tiles */
#define TK_NT ((TK_N + 31) / 32 * 2)         /* column tiles of 16, an even count */
#define TK_KT (TK_KP / 32)                   /* k tiles */
#define TK_TILE 512                          /* bf16 values in one packed tile (1 KiB) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tk_tilecfg;

static int tk_amx_state = -1;

/* Linux hands AMX's tile data to a process only once asked (arch_prctl); 0 when granted. */
void tk_init(void) {
    if (tk_amx_state < 0) tk_amx_state = (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */);
}

int tk_amx_ready(void) { return tk_amx_state == 0; }

/* floats (pairs of bf16) of the packed weight: three parts, TK_NT column tiles x TK_KT k tiles */
long tk_packed_floats(void) { return 3L * TK_NT * TK_KT * TK_TILE / 2; }

static void tk_tiles_on(void) {
    tk_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* 16 floats -> three bf16 parts (h, m, l) by round-to-nearest-even; x - h and x - h - m are
 * exact in float32. */
TK_INLINE void tk_split16(__m512 x, __m256i *h, __m256i *m, __m256i *l) {
    __m256i hb = (__m256i)_mm512_cvtneps_pbh(x);
    __m512 r = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hb), 16)));
    __m256i mb = (__m256i)_mm512_cvtneps_pbh(r);
    r = _mm512_sub_ps(r, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(mb), 16)));
    *h = hb;
    *m = mb;
    *l = (__m256i)_mm512_cvtneps_pbh(r);
}

/* The packed layout of part p, column tile j, k tile t: ((p * NT + j) * KT + t) * 512 bf16; in
 * a tile, k pair r, column c: r * 32 + c * 2 + k % 2. */
#define TK_PACKED(p, j, t) ((((long)(p) * TK_NT + (j)) * TK_KT + (t)) * TK_TILE)

/* Tile row r (k pair k, k + 1) of the three parts of a column tile from the 16 values of
 * B(k, ..) and B(k + 1, ..) (a, b): each split, then the two interleaved as pairs; part 0's
 * tile at dst, the others plane and 2 plane on. */
TK_INLINE void tk_pack_pair_at(__m512 a, __m512 b, uint16_t *restrict dst, long plane, long r) {
    __m256i pa[3], pb[3];
    tk_split16(a, &pa[0], &pa[1], &pa[2]);
    tk_split16(b, &pb[0], &pb[1], &pb[2]);
    for (int p = 0; p < 3; ++p) {
        __m256i lo = _mm256_unpacklo_epi16(pa[p], pb[p]), hi = _mm256_unpackhi_epi16(pa[p], pb[p]);
        uint16_t *row = dst + p * plane + r * 32;
        _mm256_store_si256((__m256i *)row, _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_store_si256((__m256i *)(row + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
}

/* r[i] <- the 16 x 16 matrix of 32-bit values r transposed (four rounds of unpacks and lane
 * shuffles). */
TK_INLINE void tk_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; ++j) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; ++j) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* The three parts' tiles of the column tile at column n0 and the k tile at row k0 of B(k, n) =
 * B[k * sk + n * sn] (K x N), part 0's at dst, the others plane and 2 plane on; zeros past N
 * and K. Rows of B contiguous in n (sn = 1, a GEMM's B) are read as vectors, a k pair's two
 * interleaved; rows contiguous in k (sk = 1, a Linear's weight W[n, k]: sn = K) as a 16 x 32
 * block, each row's 32 values split to 16 (k, k + 1) pairs a part, the 16 x 16 pairs
 * transposed to tile rows. */
static void tk_pack_tile(const float *restrict B, long sk, long sn, long n0, long k0, uint16_t *restrict dst,
                         long plane) {
    long cols = n0 >= TK_N ? 0 : tk_min(16, TK_N - n0), rows = tk_min(32, TK_K - k0);
    if (sn == 1) {
        __mmask16 mask = (__mmask16)((1u << cols) - 1);
        for (long i = 0; i < 32; i += 2) {
            __m512 a = i < rows ? _mm512_maskz_loadu_ps(mask, B + (k0 + i) * sk + n0) : _mm512_setzero_ps();
            __m512 b = i + 1 < rows ? _mm512_maskz_loadu_ps(mask, B + (k0 + i + 1) * sk + n0) : _mm512_setzero_ps();
            tk_pack_pair_at(a, b, dst, plane, i / 2);
        }
        return;
    }
    __mmask16 lo = rows >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rows) - 1);
    __mmask16 hi = rows >= 32 ? (__mmask16)0xffff : rows > 16 ? (__mmask16)((1u << (rows - 16)) - 1) : 0;
    __m512i part[3][16];
    for (long c = 0; c < 16; ++c) {
        const float *row = B + (n0 + c) * sn + k0;
        __m512 a = c < cols ? _mm512_maskz_loadu_ps(lo, row) : _mm512_setzero_ps();
        __m512 b = c < cols ? _mm512_maskz_loadu_ps(hi, row + 16) : _mm512_setzero_ps();
        __m256i pa[3], pb[3];
        tk_split16(a, &pa[0], &pa[1], &pa[2]);
        tk_split16(b, &pb[0], &pb[1], &pb[2]);
        for (int p = 0; p < 3; ++p) part[p][c] = _mm512_inserti64x4(_mm512_castsi256_si512(pa[p]), pb[p], 1);
    }
    for (int p = 0; p < 3; ++p) {
        tk_transpose16(part[p]);
        for (int r = 0; r < 16; ++r) _mm512_store_si512((__m512i *)(dst + p * plane + r * 32), part[p][r]);
    }
}

/* All of B (a matrix) into the packed layout, every tile written. [K, N]: a k tile's 32 rows of
 * B at a time, read along them, a column tile's three tiles written whole (column tiles
 * outermost, each a run down 32-2048 rows a page apart, packed 2048^2 in 3.3 ms against 2.4
 * this way); [N, K]: a column tile's k tiles in turn. */
static void tk_pack_b(const float *restrict B, long sk, long sn, uint16_t *restrict wp, int nthreads) {
    const long plane = (long)TK_NT * TK_KT * TK_TILE;
    if (sn == 1) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
        for (long t = 0; t < TK_KT; ++t)
            for (long j = 0; j < TK_NT; ++j) tk_pack_tile(B, sk, sn, j * 16, t * 32, wp + TK_PACKED(0, j, t), plane);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (long j = 0; j < TK_NT; ++j)
        for (long t = 0; t < TK_KT; ++t) tk_pack_tile(B, sk, sn, j * 16, t * 32, wp + TK_PACKED(0, j, t), plane);
}

/* The source of the tiles split where they are used: tk_pack_tile (B a matrix), or another
 * function of the same arguments that a file including this one names before it
 * (tessera_gemm_amx.h: a convolution's input read as its im2col matrix, never written out). */
#ifndef TK_B_TILE
#define TK_B_TILE tk_pack_tile
#endif

/* Column pair jp of B, k tiles t0 .. t0 + kts, into a thread's scratch ws laid out as the packed
 * weight's slice: [part][column tile 0, 1][k tile] (kts tiles a column tile): the per-call GEMM
 * whose rows fit one row block splits B where it is used, each column pair's slice once, and
 * never writes the whole packed B to memory and reads it back. */
#define TK_WS_PLANE(kts) (2L * (kts) * TK_TILE)
static void tk_split_b_pair(const float *restrict B, long sk, long sn, long jp, long t0, long kts,
                            uint16_t *restrict ws) {
    for (long t = 0; t < kts; ++t)
        for (int c = 0; c < 2; ++c)
            TK_B_TILE(B, sk, sn, (2 * jp + c) * 16, (t0 + t) * 32, ws + (c * kts + t) * TK_TILE, TK_WS_PLANE(kts));
}

/* W: N x K row-major (torch's Linear.weight). */
void tk_pack_weight(const float *restrict W, float *restrict packed) { tk_pack_b(W, 1, TK_K, (uint16_t *)packed, 1); }

/* The calling thread's split block of X: three planes of TK_MB (rounded up to 32) rows by TK_KCP
 * bf16, allocated once and kept. A plane holds tiles: for each 16 rows and 32 columns, one
 * contiguous tile (16 rows of 32, 1 KiB), a row's tiles in k order (rows read in place, 16 lines
 * a tile at the block's row stride, waited on L2 twice as long: 1.4x the time of a layer
 * at 256 rows when they were all in L1). */
#define TK_MBP ((TK_MB + 31) / 32 * 32)
static __thread uint16_t *tk_xs;

/* Rows ic .. ic + mb of X, columns pc .. pc + kc, split into the three planes, zeros past the
 * rows and columns; called inside the team's parallel region, the rows shared among them. */
static void tk_split_x(const float *restrict X, long ic, long mb, long pc, long kc, uint16_t *restrict xs) {
    long rows = (mb + 31) / 32 * 32, plane = (long)TK_MBP * TK_KCP;
#pragma omp for schedule(static)
    for (long i = 0; i < rows; ++i) {
        uint16_t *h = xs + (i / 16) * TK_KCP * 16 + (i % 16) * 32, *m = h + plane, *l = m + plane;
        const float *x = X + (ic + i) * TK_K + pc;
        for (long k = 0; k < TK_KCP; k += 16) {
            long valid = i < mb ? tk_min(16, kc - k) : 0, at = (k / 32) * TK_TILE + k % 32;
            __mmask16 mask = valid > 0 ? (__mmask16)((1u << valid) - 1) : 0;
            __m256i hb, mb16, lb;
            tk_split16(_mm512_maskz_loadu_ps(mask, x + k), &hb, &mb16, &lb);
            _mm256_store_si256((__m256i *)(h + at), hb);
            _mm256_store_si256((__m256i *)(m + at), mb16);
            _mm256_store_si256((__m256i *)(l + at), lb);
        }
    }
}

/* The 32 x 32 block of Y at rows row, columns n0 (rows < mr and columns < TK_N valid):
 * c holds its sums (row stride 32). Not the last k block: the partial sums are stored. The
 * last: + bias (when not NULL) (+ R), GELU, stored. */
/* The valid columns of the 16 from col (< TK_N) */
TK_INLINE __mmask16 tk_col_mask(long col) {
    return TK_N - col >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (TK_N - col)) - 1);
}

/* Y's layout: row-major [M, TK_N]; or, where the including file defines TK_Y_PLANE (a
 * convolution's images side by side along N), [TK_N / TK_Y_PLANE images][TK_Y_ROWS][TK_Y_PLANE]:
 * columns are contiguous up to the end of their image's plane. */
#ifdef TK_Y_PLANE
#define TK_YAT(Y, row, col) ((Y) + (col) / TK_Y_PLANE * (long)TK_Y_ROWS * TK_Y_PLANE + (row) * (long)TK_Y_PLANE + \
                             (col) % TK_Y_PLANE)
#define TK_YRUN(col) (TK_Y_PLANE - (col) % TK_Y_PLANE)
#else
#define TK_YAT(Y, row, col) ((Y) + (row) * (long)TK_N + (col))
#define TK_YRUN(col) ((long)TK_N - (col))
#endif

/* The lanes of v in mask to columns col .. col + 15 of row `row` of Y, or (load) from them: one
 * masked access a contiguous run (one for row-major Y) */
#ifdef TK_Y_PLANE
TK_INLINE void tk_y_store(float *restrict Y, long row, long col, __m512 v, __mmask16 mask) {
    for (long done = 0; done < 16 && col + done < TK_N;) {
        long run = tk_min(TK_YRUN(col + done), 16 - done);
        _mm512_mask_storeu_ps(TK_YAT(Y, row, col + done) - done, (__mmask16)((((1u << run) - 1) << done) & mask), v);
        done += run;
    }
}

TK_INLINE __m512 tk_y_load(const float *restrict Y, long row, long col, __mmask16 mask) {
    __m512 v = _mm512_setzero_ps();
    for (long done = 0; done < 16 && col + done < TK_N;) {
        long run = tk_min(TK_YRUN(col + done), 16 - done);
        v = _mm512_mask_loadu_ps(v, (__mmask16)((((1u << run) - 1) << done) & mask), TK_YAT(Y, row, col + done) - done);
        done += run;
    }
    return v;
}
#else
TK_INLINE void tk_y_store(float *restrict Y, long row, long col, __m512 v, __mmask16 mask) {
    _mm512_mask_storeu_ps(TK_YAT(Y, row, col), mask, v);
}

TK_INLINE __m512 tk_y_load(const float *restrict Y, long row, long col, __mmask16 mask) {
    return _mm512_maskz_loadu_ps(mask, TK_YAT(Y, row, col));
}
#endif

static void tk_store_block(const float *restrict c, float *restrict Y, long row, long n0, long mr, int last,
                           const float *restrict bias, const float *restrict R, int gelu) {
    for (long i = 0; i < mr; ++i)
        for (int v = 0; v < 2; ++v) {
            long col = n0 + v * 16;
            if (col >= TK_N) break;
            __mmask16 mask = tk_col_mask(col);
            __m512 s = _mm512_load_ps(c + i * 32 + v * 16);
            if (last) {
                if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, bias + col));
                if (R) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, R + (row + i) * TK_N + col));
                if (gelu) s = tk_gelu(s);
            }
            tk_y_store(Y, row + i, col, s, mask);
        }
}

/* The partial sums of a block from Y into the accumulator tiles: straight from Y (row stride
 * TK_N) when the block is whole, else through c (row stride 32) with zeros where not valid. */
static void tk_load_block(float *restrict c, const float *restrict Y, long row, long n0, long mr) {
#ifndef TK_Y_PLANE
    if (mr == 32 && n0 + 32 <= TK_N) {
        const float *y = Y + row * TK_N + n0;
        _tile_loadd(0, y, TK_N * 4);
        _tile_loadd(1, y + 16, TK_N * 4);
        _tile_loadd(2, y + 16 * TK_N, TK_N * 4);
        _tile_loadd(3, y + 16 * TK_N + 16, TK_N * 4);
        return;
    }
#endif
    memset(c, 0, 32 * 32 * sizeof(float));
    for (long i = 0; i < mr; ++i)
        for (int v = 0; v < 2; ++v) {
            long col = n0 + v * 16;
            if (col >= TK_N) break;
            _mm512_store_ps(c + i * 32 + v * 16, tk_y_load(Y, row + i, col, tk_col_mask(col)));
        }
    _tile_loadd(0, c, 128);
    _tile_loadd(1, c + 16, 128);
    _tile_loadd(2, c + 16 * 32, 128);
    _tile_loadd(3, c + 16 * 32 + 16, 128);
}

/* Four accumulator tiles (0: rows 0-15 x cols 0-15, 1: rows 0-15 x 16-31, 2: rows 16-31 x
 * 0-15, 3: 16-31 x 16-31) take one k block's products: X's part (tiles 4, 5) with W's part given
 * (tiles 6, 7). A block of at most 16 rows (a short request alone) runs tiles 0 and 1 only. Tile 6's
 * products come first, so the next load of tile 6 waits less on its last reader (tiles are not
 * renamed: 2048^3 ran 1.03x this way in interleaved runs on the Intel VM; W's parts and columns
 * laid out side by side, one stream a column pair, ran 0.95x the separate streams here). */
#define TK_PRODUCTS(wpart)                                                                     \
    do {                                                                                       \
        _tile_loadd(6, (wpart) + b0, 64);                                                     \
        _tile_loadd(7, (wpart) + b1, 64);                                                     \
        _tile_dpbf16ps(0, 4, 6);                                                               \
        if (two) _tile_dpbf16ps(2, 5, 6);                                                      \
        _tile_dpbf16ps(1, 4, 7);                                                               \
        if (two) _tile_dpbf16ps(3, 5, 7);                                                      \
    } while (0)

/* The next column pair's W (its six ranges: three parts, two column tiles, this k block's
 * tiles each) is fetched into L2 while this pair's products run, a share of it per row pair
 * and a few lines a k tile (a burst at a block's start held the line-fill buffers the tile
 * loads wait on, and ran slower than none): a model's packed weights outgrow the caches. */
typedef struct {
    const char *range[6];
    long from, lines_per_t, to; /* bytes of each range this block fetches: from .. to */
} tk_wfetch;

/* W's tiles: part p, column tile j, k tile t at wp + p wplane + (j jstride + t) TK_TILE (the packed
 * weight: wplane = TK_NT TK_KT TK_TILE, jstride = TK_KT; a split column pair's scratch: its own) */
TK_INLINE void tk_block(const uint16_t *restrict xs, long i0, const uint16_t *restrict wp, long wplane, long jstride,
                        long j, long t0, long kts, int two, int small, const tk_wfetch *pf) {
    const long plane = (long)TK_MBP * TK_KCP;
    const uint16_t *w[3] = {wp, wp + wplane, wp + 2 * wplane};
    long at = pf ? pf->from : 0;
    for (long t = 0; t < kts; ++t) {
        if (pf)
            for (long l = 0; l < pf->lines_per_t && at < pf->to; ++l, at += 64)
                for (int r = 0; r < 6; ++r) _mm_prefetch(pf->range[r] + at, _MM_HINT_T1);
        long b0 = ((j * jstride) + t0 + t) * TK_TILE, b1 = b0 + jstride * TK_TILE;
        /* X's part a with W's parts: the large sum h.h alone, or the small ones h.(m, l), m.(h, m), l.h */
        for (int a = 0; a < (small ? 3 : 1); ++a) {
            const uint16_t *x = xs + a * plane + i0 * TK_KCP + t * TK_TILE;
            _tile_loadd(4, x, 64);
            if (two) _tile_loadd(5, x + 16 * TK_KCP, 64);
            if (!small) {
                TK_PRODUCTS(w[0]);
            } else if (a == 0) {
                TK_PRODUCTS(w[1]);
                TK_PRODUCTS(w[2]);
            } else {
                TK_PRODUCTS(w[0]);
                if (a == 1) TK_PRODUCTS(w[1]);
            }
        }
    }
}

/* The four accumulator tiles into c (row stride 32) */
TK_INLINE void tk_tiles_out(float *c) {
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
}

TK_INLINE void tk_tiles_zero(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static __thread uint16_t *tk_ws; /* a thread's split column pair of B (tk_split_b_pair) */

/* Y = X W^T (+ bias, + R when not NULL), then GELU of each value when gelu is not 0, then, when
 * gamma is not NULL, LayerNorm of each row (gamma, beta, eps). X: M x K, Y and R: M x N. W is
 * the packed Wp, or (Wp NULL) B(k, n) = B[k * sk + n * sn], each column pair split where the
 * team uses it (once a row block of X). With Wp NULL, batch products share X, each with a B
 * bstride floats after the last and a Y M N after: X's block is split once for all of them. */
static void tk_dense_core(const float *restrict X, long M, const float *restrict Wp, const float *restrict B,
                          long sk, long sn, long batch, long bstride, const float *restrict bias,
                          const float *restrict R, float *restrict Y, const float *restrict gamma,
                          const float *restrict beta, float eps, int gelu, int nthreads) {
    if (!tk_xs) tk_xs = (uint16_t *)tk_alloc(3L * TK_MBP * TK_KCP / 2);
    uint16_t *xs = tk_xs;  /* the calling thread's; the team's threads read it */
    const uint16_t *wp = (const uint16_t *)Wp;
    /* M in blocks of near-equal rows (multiples of 32), as few as hold at most TK_MB each */
    long nblocks = (M + TK_MB - 1) / TK_MB, step = (M + nblocks - 1) / nblocks;
    step = tk_min((step + 31) / 32 * 32, TK_MBP);
    /* one parallel region a call (a region a block was 48 a call at 2048 x 768 x 3072, each a
     * fork and join the team's threads wait on) */
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float c[32 * 32] __attribute__((aligned(64))), cs[32 * 32] __attribute__((aligned(64)));
        tk_tiles_on();
        for (long ic = 0; ic < M; ic += step) {
            long mb = tk_min(step, M - ic);
            for (long pc = 0; pc < TK_K; pc += TK_KCP) {
                long kc = tk_min(TK_KCP, TK_K - pc), kts = (kc + 31) / 32;
                int first = pc == 0, last = pc + kc >= TK_K;
                /* its barrier: all of the block split before any tile, and no thread splits the
                 * next block before every thread is done with this one (the end of the loop below) */
                tk_split_x(X, ic, mb, pc, kc, xs);
                const uint16_t *w = wp;
                long wplane = (long)TK_NT * TK_KT * TK_TILE, jstride = TK_KT, t0 = pc / 32;
                if (!wp) {
                    if (!tk_ws) tk_ws = (uint16_t *)tk_alloc(3L * TK_WS_PLANE(TK_KCP / 32) / 2);
                    w = tk_ws, wplane = TK_WS_PLANE(kts), jstride = kts, t0 = 0;
                }
                for (long bi = 0; bi < (wp ? 1 : batch); ++bi) {
                    const float *Bb = wp ? 0 : B + bi * bstride;
                    float *Yb = Y + bi * M * TK_N;
#pragma omp for schedule(static)
                    for (long jp = 0; jp < TK_NT / 2; ++jp) {
                        if (!wp) tk_split_b_pair(Bb, sk, sn, jp, pc / 32, kts, tk_ws);
                        long jw = wp ? 2 * jp : 0;
                        for (long i0 = 0; i0 < mb; i0 += 32) {
                            long mr = tk_min(32, mb - i0), row = ic + i0, n0 = jp * 32;
                            tk_wfetch fetch, *pf = 0;
                            if (wp && jp + 1 < TK_NT / 2) {
                                long bytes = kts * TK_TILE * 2, shares = (mb + 31) / 32, per = (bytes + shares - 1) / shares;
                                per = (per + 63) / 64 * 64;
                                for (int r = 0; r < 6; ++r)
                                    fetch.range[r] = (const char *)(wp + (r / 2) * (long)TK_NT * TK_KT * TK_TILE +
                                                                    ((2 * jp + 2 + r % 2) * TK_KT + pc / 32) * TK_TILE);
                                fetch.from = i0 / 32 * per;
                                fetch.to = tk_min(fetch.from + per, bytes);
                                fetch.lines_per_t = (per / 64 + kts - 1) / kts;
                                pf = &fetch;
                            }
                            /* the small products first, in tiles of their own (2^-8 of the sum's size:
                             * their roundings 2^-8 of the sum's), then the large ones onto the
                             * sum so far; one AMX product rounds its sum at each term, so all six in
                             * one sum rounded it six times a term, 2.3x a float32 GEMM's error at
                             * K = 3072, this order as little as a float32 GEMM */
                            tk_tiles_zero();
                            if (mr > 16)
                                tk_block(xs, i0, w, wplane, jstride, jw, t0, kts, 1, 1, pf);
                            else  /* two calls: each inlined with its tile count a constant */
                                tk_block(xs, i0, w, wplane, jstride, jw, t0, kts, 0, 1, pf);
                            tk_tiles_out(cs);
                            if (first) {
                                tk_tiles_zero();
                            } else {
                                tk_load_block(c, Yb, row, n0, mr);
                            }
                            if (mr > 16)
                                tk_block(xs, i0, w, wplane, jstride, jw, t0, kts, 1, 0, 0);
                            else
                                tk_block(xs, i0, w, wplane, jstride, jw, t0, kts, 0, 0, 0);
                            tk_tiles_out(c);
                            for (int v = 0; v < 32 * 32; v += 16)
                                _mm512_store_ps(c + v, _mm512_add_ps(_mm512_load_ps(c + v), _mm512_load_ps(cs + v)));
                            tk_store_block(c, Yb, row, n0, mr, last, bias, R, gelu);
                        }
                    }
                }
            }
            if (gamma) {
#pragma omp single
                tk_layer_norm_rows(Y + ic * TK_N, mb, gamma, beta, eps);
            }
        }
        _tile_release();
    }
}

void tk_dense(const float *restrict X, long M, const float *restrict Wp, const float *restrict bias,
              const float *restrict R, float *restrict Y, const float *restrict gamma,
              const float *restrict beta, float eps, int gelu, int nthreads) {
    tk_dense_core(X, M, Wp, 0, 0, 0, 1, 0, bias, R, Y, gamma, beta, eps, gelu, nthreads);
}

#endif
