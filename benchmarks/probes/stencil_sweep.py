"""The ete73 constant sweep on 1 thread under the benchmark's register block (4 planes x 2
rows) at several grids (48^3 in L2 to 256^3 from memory) and tiles (8 x 4, deep in z, tall in
y), against the 73-FMA bound at the FMA peak measured here: whether a cache level binds it.
Medians of 5 interleaved rounds, each the best of 5 sweeps.

    .venv/bin/python benchmarks/probes/stencil_sweep.py > benchmarks/results/intel-vm/stencil-sweep.txt
"""

import statistics
import time

import numpy as np

from tessera.kernels.machine import cpu_description, peak_flops
from tessera.stencil import compile_stencil, make_stencil, padded_shape, weight_arrays
from tessera.stencil.schedule import StencilSchedule


def main() -> None:
    st = make_stencil("ete73", "constant")
    peak = peak_flops(1, seconds=0.3, isa="avx512")
    print(f"# {cpu_description()}; ete73 constant, 1 thread, FMA peak {peak / 1e9:.1f} GFLOP/s")
    for n in (48, 64, 128, 256):
        grid = (n, n, n)
        u = np.random.default_rng(0).standard_normal(padded_shape(grid, st.halo)).astype(np.float32)
        out = np.zeros_like(u)
        tiles = {"tile 8x4": (8, 4), "deep z": (n, 8), "tall y": (8, n)}
        kernels = {name: compile_stencil(st, grid, StencilSchedule(isa="avx512", tz=tz, ty=ty, rz=4, ry=2))
                   for name, (tz, ty) in tiles.items()}
        times = {name: [] for name in kernels}
        for _ in range(5):
            for name, kernel in kernels.items():
                kernel(u, weight_arrays(st, "ete73", grid), out=out)
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    kernel(u, {}, out=out)
                    best = min(best, time.perf_counter() - t0)
                times[name].append(best)
        bound = 2 * len(st.points) * n**3 / peak
        print(f"{n}^3: " + ", ".join(f"{name} {bound / statistics.median(t):.3f}" for name, t in times.items())
              + " of the 73-FMA bound")


if __name__ == "__main__":
    main()
