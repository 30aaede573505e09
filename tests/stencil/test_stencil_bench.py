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
    # probes that alternate 40 and 80 GB/s (this VM drifts by that much): each round's
    # fraction must use its own probe, so the rounds' fractions spread about 2x
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
    assert head["bandwidth_probes"] >= 8 and (head["dram_read_gbs_min"], head["dram_read_gbs_max"]) == (40, 80)
    for r in data["rows"]:
        if "fraction_max" in r:  # 2 rounds, one at each probe: the fractions differ by the probes' ratio
            # within 1.4-3.5x: the two rounds' kernel times differ only by timing noise on this tiny grid
            assert 1.4 < r["fraction_max"] / r["fraction_min"] < 3.5, r
            assert r["fraction_min"] <= r["roofline_fraction"] <= r["fraction_max"]
    large = [r for r in data["rows"] if r["case"].endswith("32^3")]
    assert {r["case"] for r in large} == {"star7 constant 32^3", "star7 variable 32^3"}
    assert head["large_grid"] == 32 and head["roofline_fraction_large_min"] > 0
