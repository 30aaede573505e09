"""`tessera bench stencil --quick` on one shape (Devito off: it is an optional peer)."""

import dataclasses
import json

from tessera.bench import stencil as bench
from tessera.bench.harness import write_results


def test_quick_bench_writes_results(tmp_path, monkeypatch, machine):
    import tessera.kernels.machine as machine_module

    # the full run measures the machine; here the hand-described one stands in (seconds saved)
    monkeypatch.setattr(machine_module, "load_machine", lambda: machine)
    monkeypatch.setattr(machine_module, "dram_bandwidth", lambda threads: (43.9e9, 33.6e9))
    monkeypatch.setattr(machine_module, "dram_streams_read_bandwidth", lambda threads: {8: 45e9, 16: 44e9})
    # fresh-buffer probes (one per case: 2 kinds, the wave, 2 large) alternating 40 and 80 GB/s: reported only
    probes = iter([(40e9, 30e9), (80e9, 60e9)] * 1000)
    monkeypatch.setattr(machine_module, "dram_probe", lambda threads: next(probes))
    monkeypatch.setattr(bench, "QUICK", dataclasses.replace(bench.QUICK, shapes=("star7",), devito=False, grid=24,
                                                             wave_grid=24, large_grid=32))
    result = bench.run_stencil_bench(quick=True)
    paths = write_results(result, tmp_path, bench.plot_stencil)
    data = json.loads(paths[0].read_text())
    assert data["headline"]["devito"] == "absent: skipped"
    methods = {(r["case"], r["method"]) for r in data["rows"]}
    assert {("star7 constant", "tessera"), ("star7 constant", "torch conv3d"), ("star7 variable", "numpy (1 thread)"),
            ("star7 variable", "tessera decomposed"), ("star7 variable", "tessera undecomposed")} <= methods
    for r in data["rows"]:
        if "max_rel_diff" in r:
            assert r["max_rel_diff"] < 1e-5, r  # float32 sums of 7 terms, contraction and order apart
    head = data["headline"]
    assert head["roofline_fraction_variable_max"] > 0 and paths[2].stat().st_size > 10_000
    assert head["bandwidth_probes"] == 5 and (head["dram_read_gbs_min"], head["dram_read_gbs_max"]) == (40, 80)
    for r in data["rows"]:
        if "fraction_max" in r:
            assert r["fraction_min"] <= r["roofline_fraction"] <= r["fraction_max"]
            assert r["same_memory_gbs"] > 0
    large = [r for r in data["rows"] if r["case"].endswith("32^3")]
    assert {r["case"] for r in large} == {"star7 constant 32^3", "star7 variable 32^3"}
    assert head["large_grid"] == 32 and head["roofline_fraction_large_min"] > 0


def test_sandwiched_divides_each_sweep_by_the_probes_around_it():
    """A sweep of 20 ms between probes of 10 and 30 ms: the fraction is their mean over the
    sweep, ~1.0 every time; dividing by only the probe before would alternate 0.5 and 1.5."""
    import time

    from tessera.bench.stencil_roofline import sandwiched

    probes = iter([0.010, 0.030] * 50)
    got = sandwiched({"k": lambda: time.sleep(0.02)}, lambda: next(probes), rounds=6)["k"]
    # A wall-clock measurement, so generous bounds that still tell the methods apart: sleep(0.02)
    # takes 20 ms to ~26 ms on a loaded machine (fractions 0.75-1.0) and only runs long, so a
    # fraction stays <= 1 (1.01: float slack), where dividing by one probe gives 1.5; 0.55
    # allows any sleep up to 36 ms, where dividing by both probes' sum gives 0.5.
    assert 0.55 < got.fraction_min <= got.fraction <= got.fraction_max <= 1.01
    assert got.roof_seconds in (0.010, 0.030)
    probes = iter([0.010, 0.030] * 50)
    twice = sandwiched({"k": lambda: time.sleep(0.02)}, lambda: next(probes), rounds=2, scale=2.0)["k"]
    # a run of two steps: each probe is one step's roofline, so ~2 (unscaled would be <= 1);
    # 1.1 allows a median sleep up to 36 ms, 2.02 is 2 plus float slack
    assert 1.1 < twice.fraction <= 2.02


def test_same_memory_probe_moves_exactly_the_ideal_traffic():
    """It writes the first ``count`` floats of ``out`` and nothing past them, and refuses an
    array it cannot read ``count`` float32s from, naming it."""
    import numpy as np
    import pytest

    from tessera.kernels.machine import arrays_stream_seconds

    arrays = [np.ones(1000, np.float32), np.full(1000, 2.0, np.float32)]
    out = np.full(1010, -1.0, np.float32)
    assert arrays_stream_seconds(out, arrays, 1000, 2) > 0
    assert (out[:1000] != -1.0).all() and (out[1000:] == -1.0).all()
    with pytest.raises(ValueError, match="float32 with at least 1000 elements; got float64"):
        arrays_stream_seconds(out, [np.ones(1000)], 1000, 1)
    with pytest.raises(ValueError, match=r"\(999,\)"):
        arrays_stream_seconds(out, [np.ones(999, np.float32)], 1000, 1)
