/* Tessera's machine micro-benchmark: the parameters of the performance model.
 *
 *   tk_peak_gflops(threads, seconds)   FP32 FMA throughput: every thread runs independent
 *                                      chains of vector FMAs (more chains than latency x
 *                                      ports, so only throughput limits them)
 *   tk_read_gbps(bytes, threads, s)    streaming vector reads of a buffer of `bytes` per
 *                                      thread, summed into independent accumulators: the
 *                                      bandwidth of the cache level that buffer fits in
 *   tk_write_gbps(bytes, threads, s)   streaming vector stores of such a buffer
 *   tk_streams_read_gbps(bytes, threads, streams, s)
 *                                      the same reads from `streams` arrays at once, as a
 *                                      stencil with one coefficient array per point reads:
 *                                      more concurrent streams keep more misses in flight
 *   tk_arrays_seconds(out, arrays, n, count, group, run, threads)
 *                                      one pass reading `count` floats of each of the caller's
 *                                      `n` arrays (`group` at a time, `run` floats of each in
 *                                      turn, a multiple of 8 vectors) and writing `count` of
 *                                      `out`: the ideal traffic of a sweep over those very
 *                                      buffers, in seconds
 *
 *   tk_stream_gbps(kind, nt, bytes, threads, s)
 *                                      STREAM's copy (kind 0: c = a) or triad (kind 1:
 *                                      a = b + s c) over arrays of `bytes` each per thread,
 *                                      with plain stores or non-temporal ones (nt = 1),
 *                                      counted as STREAM counts (copy 8, triad 12 bytes an
 *                                      element: no write-allocate)
 *
 * Each runs rounds until `seconds` have passed and reports its best round. Compiled with
 * TK_VEC = 256 (AVX2 + FMA) or 512 (AVX-512F).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <time.h>

#if TK_VEC == 512
typedef __m512 vf;
#define VL 16
#define LOAD _mm512_load_ps
#define LOADU _mm512_loadu_ps
#define STORE _mm512_store_ps
#define STOREU _mm512_storeu_ps
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define STREAM_NT _mm512_stream_ps
#define CHAINS 24
#else
typedef __m256 vf;
#define VL 8
#define LOAD _mm256_load_ps
#define LOADU _mm256_loadu_ps
#define STORE _mm256_store_ps
#define STOREU _mm256_storeu_ps
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define STREAM_NT _mm256_stream_ps
#define CHAINS 12
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

volatile float tk_sink;
volatile float tk_scale = 0.9999999f, tk_shift = 1e-7f;

static float fma_chains(long iters) {
    vf acc[CHAINS];
    vf b = SET1(tk_scale), c = SET1(tk_shift);
    for (int i = 0; i < CHAINS; ++i) acc[i] = SET1((float)i);
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 32
        for (int i = 0; i < CHAINS; ++i) acc[i] = FMA(acc[i], b, c);
    }
    vf s = acc[0];
    for (int i = 1; i < CHAINS; ++i) s = ADD(s, acc[i]);
    float out[VL] __attribute__((aligned(64)));
    STORE(out, s);
    return out[0];
}

double tk_peak_gflops(int threads, double seconds) {
    const long iters = 1L << 20;
    double best = 0.0, began = now();
    do {
        double t0 = 0.0, t1 = 0.0;
#pragma omp parallel num_threads(threads)
        {
#pragma omp barrier
#pragma omp master
            t0 = now();
            float r = fma_chains(iters);
#pragma omp atomic
            tk_sink += r;
#pragma omp barrier
#pragma omp master
            t1 = now();
        }
        double rate = 2.0 * CHAINS * VL * (double)iters * threads / (t1 - t0) / 1e9;
        if (rate > best) best = rate;
    } while (now() - began < seconds);
    return best;
}

/* Buffer contents no two pages share: a buffer of one repeated page can be merged by the
 * host (same-page merging) into a few physical pages, whose reads then hit the cache and
 * report far more than DRAM bandwidth (measured here: 33 GB/s one run, 86 another). */
static float fill(long i, long salt) {
    unsigned long h = (unsigned long)(i + salt * 0x9E3779B97F4A7C15UL) * 0xBF58476D1CE4E5B9UL;
    return (float)((h >> 40) & 0xFFFF) * (1.0f / 65536.0f);
}

static float read_pass(const float *buf, long floats) {
    vf a0 = SET1(0), a1 = SET1(0), a2 = SET1(0), a3 = SET1(0), a4 = SET1(0), a5 = SET1(0), a6 = SET1(0), a7 = SET1(0);
    for (long i = 0; i + 8 * VL <= floats; i += 8 * VL) {
        a0 = ADD(a0, LOAD(buf + i)); a1 = ADD(a1, LOAD(buf + i + VL));
        a2 = ADD(a2, LOAD(buf + i + 2 * VL)); a3 = ADD(a3, LOAD(buf + i + 3 * VL));
        a4 = ADD(a4, LOAD(buf + i + 4 * VL)); a5 = ADD(a5, LOAD(buf + i + 5 * VL));
        a6 = ADD(a6, LOAD(buf + i + 6 * VL)); a7 = ADD(a7, LOAD(buf + i + 7 * VL));
    }
    vf s = ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7)));
    float out[VL] __attribute__((aligned(64)));
    STORE(out, s);
    return out[0];
}

static void write_pass(float *buf, long floats, float v) {
    vf x = SET1(v);
    for (long i = 0; i + VL <= floats; i += VL) STORE(buf + i, x);
}

static double stream(long bytes, int threads, double seconds, int write) {
    long floats = (bytes / 4) / (8 * VL) * (8 * VL);
    if (floats < 8 * VL) floats = 8 * VL;
    /* enough passes per round that a round takes a few milliseconds */
    long passes = (4L << 20) / floats + 1;
    double best = 0.0, began = now();
    float **bufs = malloc(sizeof(float *) * threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num();
        bufs[t] = aligned_alloc(64, floats * 4);
        for (long i = 0; i < floats; ++i) bufs[t][i] = fill(i, t);
    }
    do {
        double t0 = 0.0, t1 = 0.0;
#pragma omp parallel num_threads(threads)
        {
            float *buf = bufs[omp_get_thread_num()];
            float r = 0.0f;
#pragma omp barrier
#pragma omp master
            t0 = now();
            for (long p = 0; p < passes; ++p) {
                if (write) write_pass(buf, floats, (float)p);
                else r += read_pass(buf, floats);
                __asm__ volatile("" ::: "memory"); /* every pass really reads or writes */
            }
#pragma omp atomic
            tk_sink += r + buf[floats - 1];
#pragma omp barrier
#pragma omp master
            t1 = now();
        }
        double rate = 4.0 * floats * passes * threads / (t1 - t0) / 1e9;
        if (rate > best) best = rate;
    } while (now() - began < seconds);
    for (int t = 0; t < threads; ++t) free(bufs[t]);
    free(bufs);
    return best;
}

double tk_read_gbps(long bytes, int threads, double seconds) { return stream(bytes, threads, seconds, 0); }
double tk_write_gbps(long bytes, int threads, double seconds) { return stream(bytes, threads, seconds, 1); }

/* Lane 0 of the sum of 8 independent accumulators (what keeps a read loop's adds from being
 * optimised away without a chain of dependent adds). */
static float sum8(const vf *a) {
    vf s = ADD(ADD(ADD(a[0], a[1]), ADD(a[2], a[3])), ADD(ADD(a[4], a[5]), ADD(a[6], a[7])));
    float out[VL] __attribute__((aligned(64)));
    STORE(out, s);
    return out[0];
}

static float read_streams(float *const *bufs, int streams, long floats) {
    vf a[8];
    for (int j = 0; j < 8; ++j) a[j] = SET1(0);
    /* 8 vectors of each stream in turn, into 8 independent sums (no add-latency chain) */
    for (long i = 0; i + 8 * VL <= floats; i += 8 * VL)
        for (int k = 0; k < streams; ++k)
            for (int j = 0; j < 8; ++j) a[j] = ADD(a[j], LOAD(bufs[k] + i + j * VL));
    return sum8(a);
}

double tk_streams_read_gbps(long bytes, int threads, int streams, double seconds) {
    long floats = (bytes / 4 / streams) / (8 * VL) * (8 * VL); /* per stream, per thread */
    if (floats < 8 * VL) floats = 8 * VL;
    double best = 0.0, began = now();
    float ***bufs = malloc(sizeof(float **) * threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num();
        bufs[t] = malloc(sizeof(float *) * streams);
        for (int k = 0; k < streams; ++k) {
            bufs[t][k] = aligned_alloc(64, floats * 4);
            for (long i = 0; i < floats; ++i) bufs[t][k][i] = fill(i, t * 64 + k);
        }
    }
    do {
        double t0 = 0.0, t1 = 0.0;
#pragma omp parallel num_threads(threads)
        {
            float *const *mine = bufs[omp_get_thread_num()];
#pragma omp barrier
#pragma omp master
            t0 = now();
            float r = read_streams(mine, streams, floats);
            __asm__ volatile("" ::: "memory");
#pragma omp atomic
            tk_sink += r;
#pragma omp barrier
#pragma omp master
            t1 = now();
        }
        double rate = 4.0 * floats * streams * threads / (t1 - t0) / 1e9;
        if (rate > best) best = rate;
    } while (now() - began < seconds);
    for (int t = 0; t < threads; ++t) {
        for (int k = 0; k < streams; ++k) free(bufs[t][k]);
        free(bufs[t]);
    }
    free(bufs);
    return best;
}

/* The caller's own buffers (numpy's: any alignment), so the figure carries their pages'
 * placement: on this VM a fresh buffer's bandwidth varies by 2x from one allocation to the
 * next while a kernel over the same arrays repeats. */
double tk_arrays_seconds(float *out, const float *const *arrays, int n, long count, int group, long run, int threads) {
    double t0 = now();
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long per = count / nt / VL * VL;
        long lo = t * per, hi = (t == nt - 1) ? count : lo + per;
        vf a[8];
        float tail = 0.0f;
        for (int j = 0; j < 8; ++j) a[j] = SET1(0);
        for (int g = 0; g < n; g += group) {
            int end = g + group < n ? g + group : n;
            long i = lo;
            /* `run` floats of each array in turn, as a stencil reads a row of each */
            for (; i + run <= hi; i += run)
                for (int k = g; k < end; ++k)
                    for (long r = i; r < i + run; r += 8 * VL)
                        for (int j = 0; j < 8; ++j) a[j] = ADD(a[j], LOADU(arrays[k] + r + j * VL));
            for (; i < hi; ++i)
                for (int k = g; k < end; ++k) tail += arrays[k][i];
        }
        vf x = SET1(tail);
        long i = lo;
        for (; i + VL <= hi; i += VL) STOREU(out + i, x);
        for (; i < hi; ++i) out[i] = tail;
        float r = sum8(a);
#pragma omp atomic
        tk_sink += r;
    }
    return now() - t0;
}

/* One STREAM kernel pass over [0, n) of this thread's arrays. */
static void stream_pass(int kind, int nt, float *restrict a, float *restrict b, const float *restrict c, long n,
                        float scalar) {
    vf s = SET1(scalar);
    if (kind == 0) {
        if (nt)
            for (long i = 0; i < n; i += VL) STREAM_NT(b + i, LOAD(a + i));
        else
            for (long i = 0; i < n; i += VL) STORE(b + i, LOAD(a + i));
    } else {
        if (nt)
            for (long i = 0; i < n; i += VL) STREAM_NT(a + i, FMA(s, LOAD(c + i), LOAD(b + i)));
        else
            for (long i = 0; i < n; i += VL) STORE(a + i, FMA(s, LOAD(c + i), LOAD(b + i)));
    }
    _mm_sfence();
}

double tk_stream_gbps(int kind, int nt, long bytes, int threads, double seconds) {
    long n = (bytes / 4) / (8 * VL) * (8 * VL);
    if (n < 8 * VL) n = 8 * VL;
    float **arr = malloc(sizeof(float *) * 3 * threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num();
        for (int k = 0; k < 3; ++k) {
            float *x = aligned_alloc(64, n * 4);
            for (long i = 0; i < n; ++i) x[i] = fill(i, t * 3 + k); /* first touch by its thread */
            arr[3 * t + k] = x;
        }
    }
    double best = 0.0, began = now();
    do {
        double t0 = 0.0, t1 = 0.0;
#pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num();
#pragma omp barrier
#pragma omp master
            t0 = now();
            stream_pass(kind, nt, arr[3 * t], arr[3 * t + 1], arr[3 * t + 2], n, tk_scale);
            __asm__ volatile("" ::: "memory");
#pragma omp barrier
#pragma omp master
            t1 = now();
        }
        double rate = (kind == 0 ? 8.0 : 12.0) * n * threads / (t1 - t0) / 1e9;
        if (rate > best) best = rate;
    } while (now() - began < seconds);
    for (int k = 0; k < 3 * threads; ++k) free(arr[k]);
    free(arr);
    return best;
}
