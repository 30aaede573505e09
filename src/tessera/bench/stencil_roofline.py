"""The memory roofline `tessera bench stencil` divides by, measured beside each kernel.

On this VM the DRAM bandwidth drifts (45 to 86 GB/s within one hour) while the kernels'
times repeat within about 10%, so one figure taken at the start of a run does not make a
fraction that repeats. Instead each case takes bandwidth probes (``kernels.machine.
dram_probe``: read with 8 and 16 streams at once, and write) interleaved with timed rounds
of its kernel; each round's fraction is the roofline time at that round's probe over the
round's kernel time, and a row reports the median round and the spread. Every probe is
kept, so the run's bandwidth is reported as a median with its range.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class BandwidthLog:
    """Every (read, write) probe of a run, in bytes/s."""

    threads: int
    samples: list[tuple[float, float]] = field(default_factory=list)

    def probe(self) -> tuple[float, float]:
        from tessera.kernels.machine import dram_probe

        sample = dram_probe(self.threads)
        self.samples.append(sample)
        return sample

    def summary(self) -> dict:
        reads = [r for r, _ in self.samples]
        writes = [w for _, w in self.samples]
        if not reads:
            return {"probes": 0}
        return {
            "probes": len(reads),
            "read_gbs_median": round(statistics.median(reads) / 1e9, 2),
            "read_gbs_min": round(min(reads) / 1e9, 2),
            "read_gbs_max": round(max(reads) / 1e9, 2),
            "write_gbs_median": round(statistics.median(writes) / 1e9, 2),
        }


def roofline_seconds(st, points: int, read_bw: float, write_bw: float) -> float:
    """Ideal bytes (each coefficient array and the field read once, the output written once)
    over the given bandwidths."""
    from tessera.stencil.model import roofline_bytes

    read, write = roofline_bytes(st)
    return points * (read / read_bw + write / write_bw)


@dataclass(frozen=True)
class Interleaved:
    seconds: float  # median round
    fraction: float  # median of the rounds' fractions
    fraction_min: float
    fraction_max: float
    read_bw: float  # bytes/s, median of the probes beside the rounds

    def fields(self) -> dict:
        return {
            "roofline_fraction": self.fraction,
            "fraction_min": round(self.fraction_min, 4),
            "fraction_max": round(self.fraction_max, 4),
            "probe_read_gbs": round(self.read_bw / 1e9, 2),
        }


def interleaved(runs: dict, roof, log: BandwidthLog, rounds: int, per_round: int = 3) -> dict[str, Interleaved]:
    """``rounds`` x (a probe, then for each of ``runs`` ``per_round`` timed calls whose median
    is its round time); ``roof(read, write)`` is the roofline seconds at a probe's
    bandwidths. Kernels compared with each other share the same probes."""
    from tessera.bench.stencil_peers import timed

    times: dict[str, list[float]] = {k: [] for k in runs}
    fractions: dict[str, list[float]] = {k: [] for k in runs}
    reads = []
    for _ in range(rounds):
        read, write = log.probe()
        reads.append(read)
        for label, run in runs.items():
            t = statistics.median(timed(run, per_round))
            times[label].append(t)
            fractions[label].append(roof(read, write) / t)
    return {
        k: Interleaved(statistics.median(times[k]), statistics.median(fractions[k]), min(fractions[k]),
                       max(fractions[k]), statistics.median(reads))
        for k in runs
    }
