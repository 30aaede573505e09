"""The high-order constant-coefficient sweeps at 256^3 under run 9's schedules on 1 and on 2
threads: a sweep bound by memory gains little from the second core, one bound in the core
about 2x. Medians of 5 interleaved rounds (range), each the best of 5 sweeps, in ms.

    .venv/bin/python benchmarks/probes/stencil_threads.py > benchmarks/results/intel-vm/stencil-threads.txt
"""

import statistics

import numpy as np

from tessera.kernels.machine import cpu_description
from tessera.stencil import compile_stencil, make_stencil, padded_shape
from tessera.stencil.schedule import StencilSchedule

RUN9 = {  # run 9's picks (docs/stencil.md, the latest run)
    "star25": StencilSchedule(isa="avx512", tz=256, ty=64, rz=2, stream=256, factor=True),
    "ete37": StencilSchedule(isa="avx512", tz=256, ty=64, rz=2, stream=256, factor=True),
    "ete73": StencilSchedule(isa="avx512", tz=8, ty=4, rz=4, ry=2),
}


def main() -> None:
    n = 256
    print(f"# {cpu_description()}; constant coefficients, {n}^3; ms, median of 5 interleaved rounds (range)")
    for name, schedule in RUN9.items():
        st = make_stencil(name, "constant")
        u = np.random.default_rng(0).standard_normal(padded_shape((n, n, n), st.halo)).astype(np.float32)
        out = np.zeros_like(u)
        kernel = compile_stencil(st, (n, n, n), schedule)
        times = {1: [], 2: []}
        for _ in range(5):
            for threads in times:
                kernel(u, {}, out=out, threads=threads)
                times[threads].append(1e3 * min(kernel.time(u, {}, threads=threads, repeats=5)))
        med = {t: statistics.median(v) for t, v in times.items()}
        print(f"{name} ({schedule.short()}): " + "; ".join(
            f"{t} thread{'s' if t > 1 else ''} {med[t]:.2f} ({min(v):.2f}-{max(v):.2f})" for t, v in times.items())
            + f"; 1 -> 2 threads {med[1] / med[2]:.2f}x")


if __name__ == "__main__":
    main()
