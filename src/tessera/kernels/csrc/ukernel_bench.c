/* The micro-kernel's rate inside its two inner loops (BLIS's macro-kernel), one register
 * tile per build (TK_VEC, TK_MR, TK_NR, TK_UNROLL defined before this file): one thread
 * runs tk_ukernel over a packed A block (about 120 rows x kc) and a packed B block (kc x
 * about 512 columns) into a C block, in either inner order (jr outer: a B micro-panel is
 * reused across A's panels; ir outer: the other way round). So the rate includes where the
 * panels live at that depth kc (a 48-wide B panel of kc = 256 is 48 KiB: L1 or not) and
 * each call's C tile load/add/store. Best round of `seconds`, in GFLOP/s. */
#define TK_NG 0
#include "tessera_primitives.h"
#include <time.h>

static double tk_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

volatile float tk_ukernel_sink;

double tk_ukernel_gflops(long kc, int ir_outer, double seconds) {
    const long mc = TK_MR * ((120 + TK_MR - 1) / TK_MR), nc = TK_NR * ((512 + TK_NR - 1) / TK_NR);
    float *a = tk_alloc(mc * kc), *b = tk_alloc(nc * kc), *c = tk_alloc(mc * nc);
    long *crow = malloc(sizeof(long) * mc);
    for (long i = 0; i < mc * kc; ++i) a[i] = 1e-3f * (float)(i % 7);
    for (long i = 0; i < nc * kc; ++i) b[i] = 1e-3f * (float)(i % 5);
    for (long i = 0; i < mc * nc; ++i) c[i] = 0.0f;
    for (long i = 0; i < mc; ++i) crow[i] = i * nc;
    double best = 0.0, began = tk_now();
    do {
        double t0 = tk_now();
        if (ir_outer) {
            for (long ir = 0; ir < mc; ir += TK_MR)
                for (long jr = 0; jr < nc; jr += TK_NR)
                    tk_ukernel(kc, a + ir * kc, 1, TK_MR, b + jr * kc, TK_NR, c + jr, crow + ir, 0, 0, TK_MR, TK_NR, 0, 0);
        } else {
            for (long jr = 0; jr < nc; jr += TK_NR)
                for (long ir = 0; ir < mc; ir += TK_MR)
                    tk_ukernel(kc, a + ir * kc, 1, TK_MR, b + jr * kc, TK_NR, c + jr, crow + ir, 0, 0, TK_MR, TK_NR, 0, 0);
        }
        __asm__ volatile("" ::: "memory");
        double rate = 2.0 * mc * nc * kc / (tk_now() - t0) / 1e9;
        if (rate > best) best = rate;
    } while (tk_now() - began < seconds);
    tk_ukernel_sink = c[0];
    free(a);
    free(b);
    free(c);
    free(crow);
    return best;
}
