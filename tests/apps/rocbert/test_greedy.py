import torch

from tessera.apps.rocbert.attacks import Synthesizer
from tessera.apps.rocbert.greedy import candidates, greedy_attack

TEXT = "这个手机很好用，推荐"


def keyword_model(texts):
    """A stand-in classifier: positive iff the text has 好 (the greedy walk must find it)."""
    calls.append(len(texts))
    p = torch.tensor([[0.1, 0.9] if "好" in t else [0.8, 0.2] for t in texts])
    return p


calls: list[int] = []


def test_greedy_finds_the_important_character(features):
    syn = Synthesizer(features)
    calls.clear()
    r = greedy_attack(keyword_model, TEXT, 1, syn, query_budget=100, seed=0)
    assert r.success and "好" not in r.text
    assert [e[0] for e in r.edits] == [TEXT.index("好")]  # ranked first, flipped at once
    assert r.queries == sum(calls) <= 100
    assert greedy_attack(keyword_model, TEXT, 1, syn, query_budget=100, seed=0) == r


def test_greedy_respects_budgets(features):
    syn = Synthesizer(features)
    r = greedy_attack(keyword_model, TEXT, 1, syn, query_budget=5, seed=0)
    assert not r.success and r.queries <= 5
    short = greedy_attack(keyword_model, "很好用", 1, syn, query_budget=100)
    assert not short.success and short.edits == []  # under 6 characters: not attacked
    wrong = greedy_attack(keyword_model, TEXT, 0, syn)
    assert wrong.success and wrong.queries == 1 and wrong.edits == []


def test_candidates_come_from_the_synthesiser(features):
    import random

    syn = Synthesizer(features)
    kinds = {name for name, _ in candidates(syn, "晴", random.Random(0))}
    assert {"pinyin_full", "homophone", "lookalike", "radical_split", "delete"} <= kinds
    assert "swap" not in kinds


def test_every_model_meets_the_same_substitutes(features, monkeypatch):
    """The substitutes tried at a position depend on (text, position, seed) only, not on the
    positions a model's own ranking visited before: the attack is the same for every system."""
    from tessera.apps.rocbert import greedy

    seen: dict[str, list] = {}
    visits: list[str] = []
    original = greedy.candidates

    def recording(syn, c, rng):
        out = original(syn, c, rng)
        seen.setdefault(c, []).append(out)
        visits.append(c)
        return out

    monkeypatch.setattr(greedy, "candidates", recording)
    syn = Synthesizer(features)
    greedy_attack(keyword_model, TEXT, 1, syn, query_budget=300, seed=0)  # visits 好 first, flips there
    # never flips; ranks 推 first, so it visits 好 only after other positions
    greedy_attack(
        lambda ts: torch.tensor([[0.1, 0.9 - 0.01 * ("推" not in t)] for t in ts]),
        TEXT,
        1,
        syn,
        query_budget=300,
    )
    assert len(seen["好"]) == 2 and seen["好"][0] == seen["好"][1]
    assert visits[0] == "好" and visits[1] == "推" and visits.index("好", 1) > 2  # other walks before
