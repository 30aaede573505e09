"""The memory roofline `tessera bench stencil` divides by: the sweep's ideal traffic timed on
the sweep's own buffers, right before and right after each timed sweep.

Why not one bandwidth figure per run: on this VM the memory bandwidth moves in time (in an
exploratory run a kernel's sweep took 34 ms one second and 85 ms a few seconds later; the
committed run's fresh-buffer probes range 32-67 GB/s), and a fresh buffer's bandwidth also differs from one allocation to
the next. A figure taken at the start of the run, or on other memory, divides one moment's
kernel by another moment's machine.

So the roofline probe (``kernels.machine.arrays_stream_seconds``) reads the field and every
coefficient array once (the first N^3 floats of each, 8 arrays at a time, 4096 floats of
each in turn) and writes N^3 floats of the output: exactly the ideal bytes, on the same
pages, in plain vector loads and stores. Each timed sweep sits between two probes and its
fraction is their mean over its time; a row reports the median over its sweeps and their
range. A fresh-buffer DRAM probe (``kernels.machine.dram_probe``) per case is kept too, to
show the machine's drift, and a STREAM-class probe (``kernels.machine.stream_probe``: copy
and triad, with and without non-temporal stores, over arrays far past the last-level cache)
before and after each case: ``stream_fraction`` divides by the better of those two probes'
mean, ``roofline_fraction`` by the own-buffer probe.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

PROBE_GROUP, PROBE_RUN = 8, 4096  # arrays read at once, floats of each in turn: the best of 8-32 x 256-16384 here


@dataclass
class BandwidthLog:
    """Every fresh-buffer (read, write) DRAM probe of a run, in bytes/s."""

    threads: int
    samples: list[tuple[float, float]] = field(default_factory=list)
    stream_bytes: int | None = None  # the STREAM probe's arrays, all together (None: past the LLC, 1 GiB+)
    streams: list[dict[str, float]] = field(default_factory=list)

    def stream(self) -> float:
        """A STREAM-class probe now (copy and triad, plain and non-temporal stores, arrays far
        past the last-level cache); its best bytes/s, kept for the summary."""
        from tessera.kernels.machine import stream_probe

        sample = stream_probe(self.threads, total_bytes=self.stream_bytes)
        self.streams.append(sample)
        return sample["best"]

    def probe(self) -> tuple[float, float]:
        from tessera.kernels.machine import dram_probe

        sample = dram_probe(self.threads)
        self.samples.append(sample)
        return sample

    def summary(self) -> dict:
        reads = [r for r, _ in self.samples]
        if not reads:
            return {"probes": 0}
        stream = {f"stream_{k}_gbs_median": round(statistics.median(s[k] for s in self.streams) / 1e9, 2)
                  for k in (self.streams[0] if self.streams else {})}  # fmt: skip
        return stream | {
            "probes": len(reads),
            "read_gbs_median": round(statistics.median(reads) / 1e9, 2),
            "read_gbs_min": round(min(reads) / 1e9, 2),
            "read_gbs_max": round(max(reads) / 1e9, 2),
            "write_gbs_median": round(statistics.median(w for _, w in self.samples) / 1e9, 2),
        }


def ideal_bytes(st, points: int) -> int:
    from tessera.stencil.model import roofline_bytes

    read, write = roofline_bytes(st)
    return points * (read + write)


def same_memory_probe(out, arrays, points: int, threads: int):
    """A function timing one pass of the ideal traffic over these buffers, in seconds:
    ``points`` floats read from each of ``arrays``, written to ``out``."""
    from tessera.kernels.machine import arrays_stream_seconds

    return lambda: arrays_stream_seconds(out, arrays, points, threads, group=PROBE_GROUP, run=PROBE_RUN)


@dataclass(frozen=True)
class Sandwiched:
    seconds: float  # median sweep
    fraction: float  # median over sweeps of (mean of the two probes around it) / its time
    fraction_min: float
    fraction_max: float
    roof_seconds: float  # median probe

    def fields(self, nbytes: int) -> dict:
        return {
            "roofline_fraction": self.fraction,
            "fraction_min": round(self.fraction_min, 4),
            "fraction_max": round(self.fraction_max, 4),
            "roofline_ms": self.roof_seconds * 1e3,
            "same_memory_gbs": round(nbytes / self.roof_seconds / 1e9, 2),
        }


def sandwiched(runs: dict, probe, rounds: int, scale: float = 1.0) -> dict[str, Sandwiched]:
    """``rounds`` x each of ``runs`` (label -> a call), every call between two probes
    (consecutive calls share one): P K1 P K2 P K1 P ... ``scale`` multiplies a probe's
    time into the run's roofline (a wave run of several steps)."""
    for run in runs.values():  # warm-up: first-touch and instruction caches
        run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    fractions: dict[str, list[float]] = {k: [] for k in runs}
    probes = [probe()]
    for _ in range(rounds):
        for label, run in runs.items():
            began = time.perf_counter()
            run()
            t = time.perf_counter() - began
            probes.append(probe())
            times[label].append(t)
            fractions[label].append(scale * (probes[-2] + probes[-1]) / 2 / t)
    roof = scale * statistics.median(probes)
    return {
        k: Sandwiched(statistics.median(times[k]), statistics.median(fractions[k]), min(fractions[k]),
                      max(fractions[k]), roof)
        for k in runs
    }
