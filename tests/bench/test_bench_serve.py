"""`tessera bench serve` end to end on a small plan: each system is started as a real
server process and loaded by the load generator in its own process, every request is
answered, each system serves the model's own embeddings, the padded baseline pads and
Tessera does not, infinity-emb is either measured or said absent, and the results are
written. (The other schedulers run the same code path; they have their own tests.)"""

import dataclasses
import json
import math

from tessera.bench.harness import write_results
from tessera.bench.serve import QUICK, plot_serve, run_serve_bench

PLAN = dataclasses.replace(
    QUICK, systems=("fifo_padded", "tessera", "infinity"), saturation_requests=32, load_requests=(16, 16)
)


def test_small_serve_bench(tmp_path):
    result = run_serve_bench(progress=False, plan=PLAN, cache=tmp_path / "cache")
    measured = {r["system"] for r in result.rows}
    assert {"fifo_padded", "tessera"} <= measured
    assert ("infinity" in measured) != ("infinity" in result.extra["absent"])  # measured, or said why not
    loads = ["saturation"] + [f"{f:.0%}" for f in PLAN.fractions]
    for system in measured:
        assert [r["load"] for r in result.rows if r["system"] == system] == loads
    for row in result.rows:
        assert row["errors"] == 0 and row["ok"] == row["requests"], row
        assert row["throughput_rps"] > 0 and 0 < row["p50_s"] <= row["p90_s"] <= row["p99_s"]
    systems = result.extra["systems"]
    # fp32 unit vectors, the packed batch against one input alone: see test_unpadded for 1e-5.
    assert systems["tessera"]["max_abs_diff_vs_model"] < 1e-5
    assert systems["fifo_padded"]["max_abs_diff_vs_model"] < 1e-5
    if "infinity" in systems:  # its own padded batches; CLS instead of mean pooling would be off by ~0.1
        # 1e-4: another server's fp32 forward (its own padding, kernels and pooling code), so 10x
        # the 1e-5 of our own batches, still 1000x below the ~0.1 of a wrong pooling
        assert systems["infinity"]["max_abs_diff_vs_model"] < 1e-4
    assert systems["fifo_padded"]["padding_overhead"] > 0.05  # padded to the longest of a batch
    assert systems["tessera"]["padding_overhead"] == 0
    assert systems["tessera"]["cost_table"]["seconds"]
    # a generous wall-clock bound: "well under a millisecond"; measured ~10 us (test_dp_scheduler)
    assert result.extra["dp_plan_us_per_request"] < 1000
    memory = result.extra["memory_plan"]  # the plan on the workload's batches, in process
    assert memory["first_pass"]["allocations"] == memory["second_pass"]["allocations"] == 0
    assert memory["held_mib"] > 0 and memory["max_ratio"] >= 1  # a placement never beats the peak
    ratio = result.headline["tessera_over_fifo_padded_throughput"]
    assert ratio is not None and math.isfinite(ratio) and ratio > 0
    paths = write_results(result, tmp_path, plot_serve)
    data = json.loads(paths[0].read_text())
    assert "tessera_p99_at_75pct_s" in data["headline"] and data["rows"]
    assert paths[2].stat().st_size > 10_000
