"""Kernels: compile one GEMM through tessera.kernels and check it against float64.

    python examples/kernels_gemm.py                     # 96 x 80 x 64, the default schedule
    python examples/kernels_gemm.py --size 1024 --tune  # the model ranks the space, a shortlist is timed

An operator is a loop nest over named axes (`ops.gemm`); a schedule says how it is cut
(register and cache tiles, loop order, packing, threads); `compile_kernel` generates C on the
BLIS-style micro-kernel, builds it with gcc into a cached shared library and calls it through
ctypes (see docs/kernels.md). With --tune, `tune` ranks every schedule with the analytic
model and times only the best few (it measures this machine first, once, if it has not yet).
"""

import argparse
import time

import numpy as np

from tessera.kernels import GemmSchedule, compile_kernel, ops, tune

UNIT_ROUNDOFF = 2.0**-24  # float32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, help="m = n = k (default: 96 x 80 x 64)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tune", action="store_true", help="choose the schedule by the model and timing")
    args = parser.parse_args()

    m, n, k = (args.size,) * 3 if args.size else (96, 80, 64)
    op = ops.gemm(m, n, k)  # C[m, n] = sum_k A[m, k] B[k, n]
    schedule = tune(op, threads=args.threads).best if args.tune else GemmSchedule()
    began = time.perf_counter()
    kernel = compile_kernel(op, schedule)  # C source -> gcc -> cached .so -> ctypes
    print(f"{op.name} {m}x{n}x{k}: {schedule.short()} compiled (or found in the cache) in "
          f"{time.perf_counter() - began:.2f} s")  # fmt: skip

    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = kernel(a, b, threads=args.threads)  # numpy arrays or torch tensors, float32

    exact = a.astype(np.float64) @ b.astype(np.float64)
    # a float32 sum of k products, each partial sum added once more per k block: at most 2k
    # roundings, so |error| <= gamma(2k) * sum |a_i b_i| per element (tests/kernels/kernel_checks.py)
    gamma = 2 * k * UNIT_ROUNDOFF / (1 - 2 * k * UNIT_ROUNDOFF)
    bound = gamma * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))
    worst = float(np.max(np.abs(c - exact) / bound))
    print(f"largest error: {worst:.3f} of the float32 bound")
    if worst > 1:
        raise SystemExit(f"the kernel's error is {worst:.3f}x the float32 bound")


if __name__ == "__main__":
    main()
