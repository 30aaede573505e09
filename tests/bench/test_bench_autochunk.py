"""`tessera bench autochunk --quick` end to end on one model (every case runs in its own
process, which is what costs time; the other models' chunking is tested in tests/autochunk):
the chunked variant uses less memory by both measures, the budget lengths are run and one
attempt of each fits its budget, and the results are written."""

import json

from tessera.bench.autochunk import plot_autochunk, run_autochunk_bench
from tessera.bench.harness import write_results

MODELS = ("gpt2-eager",)


def test_quick_autochunk_bench(tmp_path):
    result = run_autochunk_bench(quick=True, progress=False, models=MODELS)
    sweep = [r for r in result.rows if r["part"] == "sweep"]
    budget = [r for r in result.rows if r["part"] == "budget"]
    assert {(r["model"], r["variant"]) for r in sweep} == {
        (m, v) for m in MODELS for v in ("original", "autochunk")
    }
    for row in sweep:
        if row["variant"] == "autochunk":
            assert row["regions"] >= 1
            # 0.3: a cut far past a few MiB of process noise (the committed full run cuts this
            # model's peak by 84-93%)
            assert row["tracked_cut"] > 0.3 and row["rss_cut"] > 0.3, row
    for model in MODELS:
        lengths = {}
        for variant in ("original", "graph", "autochunk"):
            attempts = [r for r in budget if r["model"] == model and r["variant"] == variant]
            assert attempts and all(r["run"] for r in attempts)
            fitting = [r for r in attempts if r["fits"]]
            assert fitting, attempts  # measured, not estimated
            assert all(r["rss_mib"] <= r["budget_mib"] for r in fitting)
            lengths[variant] = max(r["length"] for r in fitting)
        assert lengths["autochunk"] > max(lengths["original"], lengths["graph"]), (model, lengths)
    paths = write_results(result, tmp_path, plot_autochunk)
    data = json.loads(paths[0].read_text())
    for model in MODELS:
        entry = data["under_budget"][f"{model}@{data['budgets_mib'][0]}MiB"]
        assert entry["autochunk"]["fits"] > entry["original"]["fits"]
        assert data["headline"][f"{model}_measured_length_ratio_under_{data['budgets_mib'][0]}MiB"] > 1.0
    assert paths[2].stat().st_size > 10_000
