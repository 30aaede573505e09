"""The AMX GEMM's B split where it is used (a column pair's slice at a time) against B packed
whole first, with B on a cache line and 16 bytes off one (the tuner's two placements), in one
process, interleaved over 5 rounds (medians of 9 calls a round). Behind the rule in
``tessera.kernels.direct.amx_splits_where_used``; needs a CPU with AMX-BF16.

    .venv/bin/python benchmarks/probes/amx_split_placement.py > benchmarks/results/intel-vm/amx-split-placement.txt
"""

import statistics
import sys

import numpy as np

import tessera.kernels.direct as direct
from tessera.kernels import ops
from tessera.kernels.amx import amx_ready
from tessera.kernels.kernel import aligned_normal, compile_kernel
from tessera.kernels.machine import cpu_description

# (M, N, K, B stored [N, K], threads, kc): [K, N] with N a multiple of 1024 and not, and [N, K]
CASES = [(128, 3072, 768, False, 1, 768), (128, 3072, 768, False, 2, 768), (128, 1024, 1024, False, 1, 1024),
         (128, 1024, 1024, False, 2, 1024), (128, 2304, 768, False, 1, 768), (128, 768, 3072, False, 1, 1024),
         (129, 3071, 767, False, 1, 768), (128, 3072, 768, True, 1, 768), (128, 768, 3072, True, 1, 1024)]


def placed(x: np.ndarray, offset: int) -> np.ndarray:
    """``x`` copied to ``offset`` bytes past a page boundary."""
    buf = np.empty(x.size + 4096, dtype=np.float32)
    start = (-buf.ctypes.data % 4096 + offset) // 4
    view = buf[start:start + x.size].reshape(x.shape)
    view[...] = x
    return view


def main() -> None:
    if amx_ready() is not None:
        sys.exit(f"no AMX here: {amx_ready()}")
    print(f"# {cpu_description()}; GFLOP/s, median of 5 interleaved rounds (each the median of 9 calls)")
    print("# M N K layout threads schedule | split-where-used B-on B-off | packed-whole B-on B-off")
    rule = direct.amx_splits_where_used
    for m, n, k, tb, threads, kc in CASES:
        op = ops.gemm(m, n, k, trans_b=tb)
        a, b = aligned_normal([(m, k), (n, k) if tb else (k, n)])
        s = next(s for s in direct.amx_space(op, ("avx512",)) if s.vecs == kc)
        kernels = {}
        for fused in (True, False):
            direct.amx_splits_where_used = lambda g, rows, fused=fused: fused
            kernels[fused] = compile_kernel(op, s)
        direct.amx_splits_where_used = rule
        a0, b_on, b_off = placed(a, 0), placed(b, 64 * 18), placed(b, 64 * 18 + 16)
        times = {}
        for _ in range(5):
            for fused, kernel in kernels.items():
                for where, bb in (("on", b_on), ("off", b_off)):
                    times.setdefault((fused, where), []).append(
                        statistics.median(kernel.time(a0, bb, threads=threads, repeats=9)))
        g = {key: 2 * m * n * k / statistics.median(v) / 1e9 for key, v in times.items()}
        print(f"{m} {n} {k} {'[N,K]' if tb else '[K,N]'} {threads} {s.short()} | {g[True, 'on']:.1f} {g[True, 'off']:.1f}"
              f" | {g[False, 'on']:.1f} {g[False, 'off']:.1f} | rule: {'split' if rule(direct.amx_of(op), s.rows) else 'packed'}")


if __name__ == "__main__":
    main()
