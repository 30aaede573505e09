import json
import statistics
from types import SimpleNamespace

import pytest
import torch

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
        for attack in ("greedy", "char", "word"):
            assert 0 <= r[f"{attack}_accuracy"] <= 1 and 0 <= r[f"{attack}_success_rate"] <= 1
            assert r[f"{attack}_mean_queries"] <= 20
    summary = {s["system"]: s for s in result.extra["summary"]}
    roc = [r["clean_accuracy"] for r in result.rows if r["system"] == "rocbert"]
    plain = [r["clean_accuracy"] for r in result.rows if r["system"] == "plain_bert"]
    assert summary["rocbert"]["clean_accuracy_mean"] == sum(roc) / 2
    # two seeds: the t-interval's half-width is t(0.975, 1) = 12.706 x std / sqrt(2)
    half = 12.706 * statistics.stdev(roc) / 2**0.5
    assert summary["rocbert"]["clean_accuracy_ci95"] == pytest.approx(half, rel=1e-4)  # t to 5 digits
    gaps = [100 * (a - b) for a, b in zip(roc, plain, strict=True)]
    assert result.headline["rocbert_minus_plain_clean_accuracy_points"] == round(statistics.mean(gaps), 2)
    assert result.headline["plain_word_accuracy"] == round(summary["plain_bert"]["word_accuracy_mean"], 4)
    paths = write_results(result, tmp_path, plot_robust)
    assert json.loads(paths[0].read_text())["headline"] == result.headline
    assert "95 % interval over seeds" in paths[1].read_text() and paths[2].stat().st_size > 0


class KeywordModel(torch.nn.Module):
    """Says positive exactly when the text holds 好: a model whose every answer is known."""

    def __init__(self, good_id: int):
        super().__init__()
        self.good_id, self.anchor = good_id, torch.nn.Parameter(torch.zeros(()))  # a device to read

    def forward(self, input_ids, **_):
        has = (input_ids == self.good_id).any(-1).float()
        return SimpleNamespace(logits=torch.stack([1 - has, has], -1) * 4.0 + self.anchor)


def test_accuracies_and_success_rates_of_a_known_model(features):
    """evaluate() and greedy_metrics against what the keyword model must score, counted here
    from the texts themselves; the greedy attack must flip some of its right answers (deleting
    or replacing 好 does) and counts no already-wrong text as a flip."""
    from tessera.apps.rocbert import corpus
    from tessera.apps.rocbert.attacks import Synthesizer
    from tessera.apps.rocbert.batches import Encoder
    from tessera.apps.rocbert.recipe import EVAL_ATTACK_SEED, RocbertRecipe, evaluate
    from tessera.bench.robust import attack_metrics

    recipe = RocbertRecipe(eval_size=200)
    encoder, syn = Encoder(features.tokenizer(), recipe.size.max_len), Synthesizer(features)
    good = features.tokenizer().vocab["好"]
    model = KeywordModel(good)
    test = corpus.split_rows("validation")
    clips = [(encoder.clip(t), y) for t, y in test[:200]]
    says = lambda text: int(good in encoder([text])["input_ids"][0])  # noqa: E731 (after truncation)
    right = [says(t) == y for t, y in clips]
    attacked = [says(syn.attack(t, seed=EVAL_ATTACK_SEED)[0]) == y for t, y in clips]
    out = evaluate(model, features, recipe)
    # approx's default 1e-6 relative: evaluate() takes a float32 mean of 0/1 (~6e-8 relative
    # rounding), the count here is exact; one text more or less moves the rate by 5e-3.
    assert out["clean_accuracy"] == pytest.approx(sum(right) / 200)
    assert out["attacked_accuracy"] == pytest.approx(sum(attacked) / 200)
    turned = sum(r and not a for r, a in zip(right, attacked, strict=True))
    assert out["attack_success_rate"] == pytest.approx(turned / sum(right))  # as above: float32 count

    greedy = attack_metrics(model, features, encoder, recipe, size=40, budget=60)
    rows = [(encoder.clip(t), y) for t, y in test if len(t) >= 6][:40]
    clean_right = sum(says(t) == y for t, y in rows)
    for attack in ("greedy", "char", "word"):
        flipped = round(greedy[f"{attack}_success_rate"] * clean_right)
        # approx's default 1e-6 relative: the same count over 40 in float64, only rounding apart
        assert greedy[f"{attack}_accuracy"] == pytest.approx((clean_right - flipped) / 40)
        # both character attacks can replace 好 (homophones, look-alikes); a thesaurus may not
        assert flipped > 0 or attack == "word"
