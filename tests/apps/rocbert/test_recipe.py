"""The rocbert-sentiment recipe on a tiny RoCBert (seconds): losses fall, the export loads with
transformers' own classes, and dp=2 over two processes takes the same steps as one process.

Parity reference: one process with grad_accum=2 sees exactly the micro-batches the two ranks
see (boost splits a global batch into contiguous halves either way), which matters because the
contrastive term uses the other rows of its micro-batch as negatives. Tolerances: the ranks
average gradients with an all-reduce instead of summing two micro-batches in one process, so
they differ by fp32 rounding (~1e-7 relative per step). The parity run uses SGD: AdamW divides
by sqrt(v), which lifts a rounding difference on a near-zero gradient to a full step (it did,
with 2 threads per process, on rarely seen embedding rows), while under SGD a gradient that is
off by the world size (a sum-for-average bug) moves the weights 2x as far. Parameters after
3 + 3 steps at rtol 1e-4 / atol 1e-5, the logged losses at rtol 1e-5.
"""

import dataclasses
import json
import math
import random
import statistics

import pytest
import torch

import tessera
from tessera.apps.rocbert.model import RocbertSize, pretraining_model
from tessera.apps.rocbert.recipe import RocbertRecipe, finetune, pretrain, train_rank
from tessera.runtime import Mesh, spawn

TINY = RocbertSize(
    hidden=32, layers=1, heads=2, intermediate=64, max_len=32, pronunciation_dim=8, dropout=0.0
)


def _tiny(**kw):
    # no warm-up (1 step: the full rate at once): the recipe's 30 would leave these 16-step runs at
    # a fraction of the rate; the ramp has its own test
    base = dict(
        size=TINY,
        batch_size=8,
        news_sentences=300,
        eval_size=32,
        pretrain_lr=3e-3,
        finetune_lr=3e-3,
        warmup_steps=1,
    )
    return RocbertRecipe(**{**base, **kw})


def _run(recipe, plan, root):
    from tessera.apps.rocbert.features import load_features
    from tessera.train.export import full_state_dict

    mesh, features = Mesh(dp=plan.dp), load_features(root)
    model, opt, pre = pretrain(recipe, plan, mesh, features)
    model, opt, fine = finetune(recipe, plan, mesh, features, full_state_dict(model, opt))
    return [e["loss"] for e in pre], [e["loss"] for e in fine], full_state_dict(model, opt)


def test_tiny_run_trains_and_exports(features, tmp_path):
    from transformers import RoCBertForSequenceClassification, RoCBertTokenizer

    recipe = _tiny(pretrain_steps=16, finetune_steps=16)
    out = train_rank(recipe, tessera.Plan(dp=1), str(tmp_path), str(features.root))
    pre, fine = out["pretrain_loss"], out["finetune_loss"]
    assert sum(pre[-4:]) < 0.9 * sum(pre[:4]), pre  # 0.9: a 10% drop over 16 steps, above batch noise
    # sentiment is not learnt at this size in seconds (over 48 steps the loss stays at ln 2 +-
    # batch noise on the distinct reviews): fine-tuning is checked to run and to stay finite
    # here, and the classifier test below checks that it learns a task it can
    assert len(fine) == 16 and all(math.isfinite(x) and x < 2.0 for x in fine), fine
    assert 0 <= out["attacked_accuracy"] <= 1 and out["eval_size"] == 32
    model = RoCBertForSequenceClassification.from_pretrained(tmp_path / "model")
    tok = RoCBertTokenizer.from_pretrained(tmp_path / "model")
    enc = tok(["这个手机很好用"], return_tensors="pt")
    assert model(**enc).logits.shape == (1, 2)
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log["recipe"]["contrastive"] and len(log["finetune_loss"]) == 16
    # the glyph table is frozen: after 32 AdamW steps it is still the drawn glyph vectors
    shape = model.roc_bert.embeddings.shape_embed.weight
    assert torch.equal(shape, torch.from_numpy(features.glyphs))


def test_unfrozen_glyphs_do_train(features):
    """The other side of the frozen-glyph check above: trainable, the same table moves at once."""
    size = dataclasses.replace(TINY, freeze_shape=False)
    state = _run(
        _tiny(size=size, pretrain_steps=1, finetune_steps=1), tessera.Plan(dp=1), str(features.root)
    )[2]
    shape = state["roc_bert.embeddings.shape_embed.weight"]
    # allclose's defaults (rtol 1e-5, atol 1e-8): an AdamW step moves the entries used by ~lr (3e-3)
    assert not torch.allclose(shape, torch.from_numpy(features.glyphs))


def test_salient_positions_rank_by_the_gradient(features):
    from tessera.apps.rocbert.batches import Encoder, _by_score, salient_positions
    from tessera.apps.rocbert.features import is_hanzi
    from tessera.apps.rocbert.model import classifier_from, pretraining_model

    tok = features.tokenizer()
    assert "龘" not in tok.vocab  # an [UNK]: still matched to its position
    ids = tok("龘ab好用")["input_ids"]  # [CLS] [UNK] a ##b 好 用 [SEP]
    assert _by_score(tok, "龘ab好用", ids, [0, 1, 9, 9, 0, 5, 0]) == [4, 0, 3]
    assert _by_score(tok, "龘ab好用", ids, [0, 7, 0, 0, 9, 5, 0]) == [3, 0, 4]
    model = classifier_from(pretraining_model(features, TINY).state_dict(), features, TINY).train()
    texts = ["这个手机很好用，推荐", "ok质量差abc太糟糕了"]
    order = salient_positions(model, Encoder(tok, TINY.max_len), texts, [1, 0])
    for text, positions in zip(texts, order, strict=True):
        assert sorted(positions) == [i for i, c in enumerate(text) if is_hanzi(c)]
    assert model.training and all(p.grad is None for p in model.parameters())


def test_consistency_term_pulls_a_copy_to_its_review(features):
    from tessera.apps.rocbert.batches import Encoder
    from tessera.apps.rocbert.model import classifier_from, pretraining_model
    from tessera.apps.rocbert.recipe import _finetune_loss

    model = classifier_from(pretraining_model(features, TINY).state_dict(), features, TINY).eval()
    enc = Encoder(features.tokenizer(), TINY.max_len)
    same = {**enc(["这个手机很好用"] * 2 + ["质量差"] * 2), "labels": torch.tensor([1, 1, 0, 0])}
    ce = model(**same).loss
    # a fresh model's outputs hardly differ between texts: a large weight makes the KL visible
    torch.testing.assert_close(_finetune_loss(1e4)(model, same), ce)  # equal pairs: KL is 0
    apart = {**enc(["这个手机很好用", "质量差", "质量差", "很好用"]), "labels": torch.tensor([1, 1, 0, 0])}
    assert _finetune_loss(1e4)(model, apart) > _finetune_loss(0.0)(model, apart) == model(**apart).loss
    with pytest.raises(ValueError, match="consistency must be >= 0"):
        RocbertRecipe(consistency=-1.0)


def test_dp2_matches_one_process(features):
    recipe = _tiny(pretrain_steps=3, finetune_steps=3, optimizer="sgd", pretrain_lr=0.5, finetune_lr=0.5)
    root = str(features.root)
    # clipped as the recipe trains (the global norm is taken over both ranks' reduced gradients)
    ref_pre, ref_fine, ref_state = _run(recipe, tessera.Plan(dp=1, grad_accum=2, max_grad_norm=1.0), root)
    pre, fine, state = spawn(_run, 2, recipe, tessera.Plan(dp=2, max_grad_norm=1.0), root)[0]
    # The same gradients summed in another order (a dp all-reduce instead of 2 accumulated
    # micro-batches), then clipped: fp32 rounding, ~1e-7 relative per step (as in
    # test_boost_parity), so losses at rtol 1e-5 and, after 3 + 3 SGD steps at lr 0.5, parameters
    # at rtol 1e-4 / atol 1e-5 (an absolute floor for entries near zero).
    torch.testing.assert_close(pre, ref_pre, rtol=1e-5, atol=0)
    torch.testing.assert_close(fine, ref_fine, rtol=1e-5, atol=0)
    assert state.keys() == ref_state.keys()
    for name, t in ref_state.items():
        torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-5, msg=name)  # see above
    # and the run did move the weights, so the comparison can fail
    fresh = _run(
        _tiny(pretrain_steps=1, finetune_steps=1, optimizer="sgd", pretrain_lr=0.5, finetune_lr=0.5),
        tessera.Plan(dp=1),
        root,
    )[2]
    # allclose's defaults: 2 more SGD steps at lr 0.5 move the classifier O(lr x gradient), far more
    assert not torch.allclose(fresh["classifier.weight"], ref_state["classifier.weight"])


def test_warmup_ramps_the_rate_linearly_then_holds():
    """The LR the optimizer sees over the first steps: 1/4, 2/4, 3/4 of the rate, then all of it."""
    from tessera.apps.rocbert.recipe import _warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    scheduler = _warmup(opt, 4)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])  # default 1e-6 rel: 0.4 * k / 4 in floats
    with pytest.raises(ValueError, match="warmup_steps must be a positive integer, got 0"):
        RocbertRecipe(warmup_steps=0)


def test_recipe_is_validated():
    with pytest.raises(ValueError, match="pretrain_steps must be a positive integer"):
        RocbertRecipe(pretrain_steps=0)
    with pytest.raises(ValueError, match="not divisible by heads"):
        RocbertSize(hidden=30, heads=4)


def test_cli_train_and_attack(tmp_path, capsys):
    from tessera.cli import main

    out = tmp_path / "run"
    argv = ["train", "--recipe", "rocbert-sentiment", "--out", str(out), "--steps", "2", "--batch-size", "4"]
    assert main(argv) == 0
    assert "validation accuracy clean" in capsys.readouterr().out
    assert (
        main(["robust", "attack", "--model", str(out), "--text", "这个手机很好用，推荐", "--variants", "2"])
        == 0
    )
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == "这个手机很好用，推荐" and shown[1].startswith("  model: ")
    assert len(shown) == 7 and "greedy (" in shown[-1]
    assert shown[-3].startswith("  char attack (") and shown[-2].startswith("  word attack (")
    argv = [
        "train",
        "--recipe",
        "rocbert-sentiment",
        "--out",
        str(out),
        "--tp",
        "2",
        "--pp",
        "2",
        "--nproc",
        "4",
    ]
    assert main(argv) == 2
    assert "it does not take --tp, --pp" in capsys.readouterr().err


def test_fine_tuning_refuses_a_batch_that_splits_a_pair(features):
    recipe = _tiny(batch_size=3)
    state = pretraining_model(features, TINY).state_dict()
    with pytest.raises(ValueError, match=r"batch_size=3 does not split into dp=1 x grad_accum=2 shares"):
        finetune(recipe, tessera.Plan(dp=1, grad_accum=2), Mesh(dp=1), features, state)


KEYS = "这个手机很用我觉得东西质量服务态度推荐妈妈明天"


def _keyword_reviews(n: int, seed: int) -> list[tuple[str, int]]:
    """Reviews whose label is which of 好 / 差 they hold (a task a tiny model can learn)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randrange(2)
        chars = [rng.choice(KEYS) for _ in range(9)]
        chars.insert(rng.randrange(10), "好" if label else "差")
        rows.append(("".join(chars), label))
    return rows


def test_fine_tuning_learns_a_task_it_can(features, monkeypatch):
    """The fine-tuning stage as the recipe runs it (attacked copies, consistency term, AdamW,
    warm-up) on reviews whose sentiment is one character: the loss falls well below ln 2 and
    held-out accuracy is high, so the stage does learn when there is something to learn."""
    from tessera.apps.rocbert import corpus
    from tessera.apps.rocbert import recipe as recipe_module

    held_out = _keyword_reviews(64, 1)
    split = corpus.Splits(_keyword_reviews(400, 0), held_out, held_out)
    monkeypatch.setattr(corpus, "sentiment_splits", lambda validation_fraction=0.1, test_fraction=0.1: split)
    recipe = _tiny(finetune_steps=60, finetune_lr=1e-2, warmup_steps=5, eval_size=64)
    feats = features
    state = pretraining_model(feats, TINY).state_dict()
    model, _, log = finetune(recipe, tessera.Plan(dp=1, max_grad_norm=1.0), Mesh(dp=1), feats, state)
    losses = [e["loss"] for e in log]
    # the median: an attacked copy that lost its one telling character is a noisy row.
    # Chance is a loss of ln 2 = 0.69 and accuracy 0.5: the bounds (0.6 at the start, 0.35 at
    # the end, 0.9 accuracy) sit well away from chance, so only a stage that learns passes.
    assert statistics.median(losses[-10:]) < 0.35 < 0.6 < statistics.median(losses[:5]), losses
    assert recipe_module.evaluate(model, feats, recipe)["clean_accuracy"] > 0.9
