import json

from tessera.bench.harness import write_results
from tessera.bench.robust import RobustBenchPlan, plot_robust, run_robust_bench


def test_bench_robust_writes_its_tables(features, tmp_path):
    plan = RobustBenchPlan(
        pretrain_steps=2, finetune_steps=2, seeds=(0, 1), eval_size=16, greedy_size=4, query_budget=20,
        systems=("rocbert", "plain_bert"),
    )  # fmt: skip
    result = run_robust_bench(plan=plan, features_dir=features.root)
    assert [(r["system"], r["seed"]) for r in result.rows] == [
        ("rocbert", 0), ("rocbert", 1), ("plain_bert", 0), ("plain_bert", 1),
    ]  # fmt: skip
    for r in result.rows:
        assert 0 <= r["greedy_accuracy"] <= 1 and 0 <= r["greedy_success_rate"] <= 1
        assert r["greedy_mean_queries"] <= 20
    summary = {s["system"]: s for s in result.extra["summary"]}
    roc = [r["clean_accuracy"] for r in result.rows if r["system"] == "rocbert"]
    assert summary["rocbert"]["clean_accuracy_mean"] == sum(roc) / 2
    gap = 100 * (summary["rocbert"]["clean_accuracy_mean"] - summary["plain_bert"]["clean_accuracy_mean"])
    assert result.headline["clean_gap_points"] == round(gap, 2)
    paths = write_results(result, tmp_path, plot_robust)
    assert json.loads(paths[0].read_text())["headline"] == result.headline
    assert "Mean and spread over seeds" in paths[1].read_text() and paths[2].stat().st_size > 0
