"""`tessera bench stencil --quick` on one shape (Devito off: it is an optional peer)."""

import dataclasses
import json

import pytest

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
    # STREAM probes around each case: 50 GB/s before, 70 after (their mean divides the case's rows)
    streams = iter([50e9, 70e9] * 1000)

    def stream_probe(threads, total_bytes=None):
        best = next(streams)
        return {"copy": best * 0.9, "copy_nt": best, "triad": best * 0.8, "triad_nt": best * 0.95, "best": best}

    monkeypatch.setattr(machine_module, "stream_probe", stream_probe)
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
    for r in data["rows"]:
        if r["case"] in ("star7 constant", "star7 variable"):  # ideal bytes / time / mean(50, 70) GB/s
            arrays = 0 if r["case"] == "star7 constant" else 7
            ideal = 4 * (arrays + 2) * 24**3
            assert r["stream_gbs"] == 60.0
            assert abs(r["stream_fraction"] - ideal / (r["ms"] / 1e3) / 60e9) < 1e-9 * r["stream_fraction"]
    assert head["stream_fraction_variable_max"] > 0 and head["stream_copy_nt_gbs_median"] == 60.0
    for r in data["rows"]:
        if r["method"].startswith("tessera") and "incore_ms" in r:  # the binding bound over the time
            bound = max(r["incore_ms"], r["roofline_ms"])
            assert abs(r["bound_fraction"] - bound / r["ms"]) < 1e-9 and r["bound"] in ("in-core", "DRAM")
    assert head["bound_fraction_min"] > 0
    large = [r for r in data["rows"] if r["case"].endswith("32^3")]
    assert {r["case"] for r in large} == {"star7 constant 32^3", "star7 variable 32^3"}
    assert head["large_grid"] == 32 and head["roofline_fraction_large_min"] > 0


def test_sandwiched_divides_each_sweep_by_the_probes_around_it(monkeypatch):
    """A sweep of 20 ms between probes of 10 and 30 ms: the fraction is their mean over the
    sweep, 1.0 every time; dividing by only the probe before would alternate 0.5 and 1.5.
    The clock is the test's own (each sweep advances it 20 ms), so no wall time is judged."""
    import pytest

    import tessera.bench.stencil_roofline as roofline

    clock = [0.0]
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: clock[0])

    def sweep():
        clock[0] += 0.02

    probes = iter([0.010, 0.030] * 50)
    got = roofline.sandwiched({"k": sweep}, lambda: next(probes), rounds=6)["k"]
    exact = pytest.approx(1.0, rel=1e-12)  # the clock's float sums round in the last place
    assert got.fraction_min == exact and got.fraction == exact and got.fraction_max == exact
    assert got.seconds == pytest.approx(0.02) and got.roof_seconds in (0.010, 0.030)
    probes = iter([0.010, 0.030] * 50)
    twice = roofline.sandwiched({"k": sweep}, lambda: next(probes), rounds=2, scale=2.0)["k"]
    assert twice.fraction == pytest.approx(2.0, rel=1e-12)  # a run of two steps: each probe is one step's roofline


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


def test_stream_probe_runs_each_kernel():
    """Copy and triad, plain and non-temporal stores: each a positive rate, ``best`` their max."""
    from tessera.kernels.machine import stream_probe

    got = stream_probe(1, seconds=0.01, total_bytes=12 << 20)
    assert set(got) == {"copy", "copy_nt", "triad", "triad_nt", "best"}
    assert all(v > 0 for v in got.values()) and got["best"] == max(v for k, v in got.items() if k != "best")


FAKE_DEVITO = '''
import json, sys
from pathlib import Path
import numpy as np
spec = json.loads(Path(sys.argv[1]).read_text())
u = np.load(Path(spec["check_dir"]) / "u.npy")
h = spec["halo"]
np.save(Path(spec["check_dir"]) / "out.npy", np.zeros([n - 2 * h for n in u.shape], np.float32))
print("compiler chatter that is not an answer", flush=True)
print("ready", flush=True)
runs = 0
for line in sys.stdin:
    if line.strip() != "run":
        break
    runs += 1
    print(json.dumps({"kernel_seconds": 0.01 * runs, "wall_seconds": 0.02}), flush=True)
Path(sys.argv[2]).write_text(json.dumps({"setup_seconds": 1.0, "steps": spec["steps"], "devito": "fake"}))
'''


def test_devito_and_tessera_each_in_a_process_of_its_own(tmp_path, monkeypatch):
    """The comparison's plumbing with a stand-in for Devito's worker (Devito is an optional
    peer): both processes start, answer every round in turn and stop; Tessera's worker runs
    the real compiled kernel on ``pattern``'s arrays; a wrong answer fails the check."""
    import os
    import sys

    import numpy as np

    from tessera.bench import stencil_peers
    from tessera.bench.stencil_devito import pattern
    from tessera.stencil import compile_stencil, make_stencil

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    worker = tmp_path / "fake_devito.py"
    worker.write_text(FAKE_DEVITO)
    monkeypatch.setattr(stencil_peers, "DEVITO_VENV", venv)
    monkeypatch.setattr(stencil_peers, "WORKER", worker)
    st = make_stencil("star7", "point")
    kernel = compile_stencil(st, (8, 9, 10))
    got = stencil_peers.run_devito(st, "star7", (8, 9, 10), 1, 5, tessera={"lib": str(kernel.compiled.path)})
    assert "error" not in got, got
    assert got["kernel_seconds"] == [0.01 * r for r in range(1, 6)] and len(got["tessera_seconds"]) == 5
    assert all(t > 0 for t in got["tessera_seconds"]) and got["devito"] == "fake"
    assert got["check_ok"] is False  # the stand-in answers zeros
    with pytest.raises(ValueError, match="rounds=0; the paired comparison needs at least 1 round"):
        stencil_peers.run_devito(st, "star7", (8, 9, 10), 1, 0, tessera={"lib": str(kernel.compiled.path)})
    a, b = pattern((4, 5, 6), 0), pattern((4, 5, 6), 3)
    assert a.dtype == np.float32 and -0.5 <= a.min() and a.max() < 0.5 and 0.5 <= b.min() and b.max() < 1.5
