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
    monkeypatch.setattr(bench, "QUICK", dataclasses.replace(bench.QUICK, shapes=("star7",), devito=False, grid=24,
                                                             wave_grid=24))
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
    assert data["headline"]["roofline_fraction_variable_max"] > 0 and paths[2].stat().st_size > 10_000
