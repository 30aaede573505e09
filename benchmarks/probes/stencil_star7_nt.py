"""Probe: star7 at 256^3 on 2 threads, the stencil tuner's candidates as it times them, and
the chosen schedule against its non-temporal-store twin (``StencilSchedule.nt``) in
interleaved rounds. Asked on the Milan VM, where STREAM's copy ran 1.4x faster with
non-temporal stores while Devito's constant star7 sweep beat Tessera's (bench run 7 there):
would skipping the output's read for ownership pay in the sweep as it does in the copy?

    .venv/bin/python benchmarks/probes/stencil_star7_nt.py > benchmarks/results/amd-milan/stencil-star7-nt.txt
"""

import dataclasses
import statistics

from tessera.kernels.machine import measure, stream_probe
from tessera.stencil import compile_stencil
from tessera.stencil.stencil import make_stencil
from tessera.stencil.tune import sample_inputs, tune_stencil

GRID, THREADS, ROUNDS = (256, 256, 256), 2, 5


def main() -> None:
    machine = measure(seconds=1.0)
    print(f"cpu: {machine.cpu}; isa {machine.isa}; grid {GRID}, {THREADS} threads")
    for coefficients in ("constant", "point"):  # point: a coefficient array per offset
        stencil = make_stencil("star7", coefficients)
        inputs = sample_inputs(stencil, GRID)
        tuned = tune_stencil(stencil, GRID, threads=THREADS, machine=machine, top_k=4, repeats=3, inputs=inputs)
        print(f"\nstar7 {coefficients}: chosen {tuned.best.short()}")
        for t in tuned.trials:
            first = "-" if t.measured is None else f"{t.measured * 1e3:.2f}"
            rounds = " ".join(f"{x * 1e3:.2f}" for x in t.rounds)
            print(f"  {t.schedule.short():58s} first {first:>6} ms  finalist rounds {rounds or '-'}")
        if tuned.best.decomposed:
            continue
        kernels = {"plain": compile_stencil(stencil, GRID, dataclasses.replace(tuned.best, nt=False)),
                   "nt": compile_stencil(stencil, GRID, dataclasses.replace(tuned.best, nt=True))}
        times = {k: [] for k in kernels}
        for r in range(ROUNDS):  # interleaved, order alternating
            for name in (list(kernels) if r % 2 == 0 else list(kernels)[::-1]):
                times[name].append(statistics.median(kernels[name].time(*inputs, threads=THREADS, repeats=5)))
        for name, ts in times.items():
            print(f"  {name:5s} stores: median {statistics.median(ts) * 1e3:.2f} ms over {ROUNDS} rounds "
                  f"({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})")
    gbs = stream_probe(THREADS)
    print("\nSTREAM-class probe after, GB/s: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in gbs.items()))


if __name__ == "__main__":
    main()
