"""`tessera bench autochunk --quick` end to end: every case runs in its own process, the
chunked variant uses less memory by both measures, and the results are written."""

import json

from tessera.bench.autochunk import plot_autochunk, run_autochunk_bench
from tessera.bench.harness import write_results


def test_quick_autochunk_bench(tmp_path):
    result = run_autochunk_bench(quick=True, progress=False)
    assert {(r["model"], r["variant"]) for r in result.rows} == {
        (m, v) for m in ("evoformer", "gpt2") for v in ("original", "autochunk")
    }
    for row in result.rows:
        if row["variant"] == "autochunk":
            assert row["regions"] >= 1
            assert row["tracked_cut"] > 0.3 and row["rss_cut"] > 0.3, row
    for key, value in result.headline.items():
        if key.endswith("MiB"):
            assert value > 1.0, (key, value)  # chunked fits a longer length under the same budget
    paths = write_results(result, tmp_path, plot_autochunk)
    data = json.loads(paths[0].read_text())
    for budget in data["budgets_mib"]:
        fits = data["longest_under_budget"][f"gpt2@{budget}MiB"]
        assert fits["autochunk"] > fits["unchunked"]
    assert paths[2].stat().st_size > 10_000
