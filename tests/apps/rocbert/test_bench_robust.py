import json

import pytest

from tessera.bench.harness import write_results
from tessera.bench.robust import RobustBenchPlan, plot_robust, run_robust_bench


def test_plan_is_validated():
    with pytest.raises(ValueError, match="must hold rocbert and plain_bert"):
        RobustBenchPlan(pretrain_steps=1, finetune_steps=1, seeds=(0,), eval_size=4, greedy_size=1,
                        query_budget=5, systems=("rocbert", "bert"))  # fmt: skip


def test_bench_robust_writes_its_tables(features, tmp_path):
    # two worker processes, as the full plan runs
    plan = RobustBenchPlan(
        pretrain_steps=2, finetune_steps=2, seeds=(0, 1), eval_size=16, greedy_size=4, query_budget=20,
        systems=("rocbert", "plain_bert"), workers=2,
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
    assert result.headline["plain_greedy_accuracy"] == round(summary["plain_bert"]["greedy_accuracy_mean"], 4)
    paths = write_results(result, tmp_path, plot_robust)
    assert json.loads(paths[0].read_text())["headline"] == result.headline
    assert "Mean and spread over seeds" in paths[1].read_text() and paths[2].stat().st_size > 0
