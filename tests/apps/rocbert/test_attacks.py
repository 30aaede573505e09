import random

import pytest

from tessera.apps.rocbert.attacks import TRANSFORMS, AttackConfig, Synthesizer
from tessera.apps.rocbert.features import initial, is_hanzi

TEXT = "这个手机很好用，质量不错，服务态度也很好，推荐"


@pytest.fixture(scope="module")
def syn(features):
    return Synthesizer(features)


def one(syn, name, c, seed=0):
    return syn.transform(name, c, random.Random(seed))


def test_pinyin_transforms(syn):
    assert one(syn, "pinyin_full", "好") == "hao"
    assert one(syn, "pinyin_initial", "质") == initial("zhi") == "zh"
    for seed in range(5):
        shuffled = one(syn, "pinyin_shuffled", "好", seed)
        assert sorted(shuffled) == sorted("hao") and shuffled != "hao"
    assert one(syn, "pinyin_separated", "好") == "h a o"
    assert one(syn, "pinyin_full", "，") is None  # no pinyin, nothing to write


def test_homophone_sounds_the_same(syn, features):
    produced = [(c, h) for c in "好手用质" if (h := one(syn, "homophone", c)) is not None]
    assert len(produced) >= 2, produced  # the loop below checks something
    for c, h in produced:
        assert h != c and features.pinyin[h] == features.pinyin[c]
    assert one(syn, "homophone", "情") in {"请", "清", "晴"} | set(syn.homophones("情"))


def test_lookalike_is_in_the_lookalike_set(syn):
    near = syn.lookalikes("晴")
    assert len(near) == syn.config.lookalike_k and "晴" not in near
    assert one(syn, "lookalike", "晴") in near
    assert {"睛", "清", "请", "情"} & set(near)  # the glyph vectors find some 青 relatives


def test_radical_split_and_same_component(syn):
    assert one(syn, "radical_split", "好") == "女子"
    assert syn.components("休") == ["人", "木"]
    other = one(syn, "same_component", "晴")
    assert other != "晴" and set(syn.components(other)) & set(syn.components("晴"))
    assert one(syn, "radical_split", "一") is None  # no components: nothing to split


def test_plain_edits(syn):
    ins = one(syn, "insert", "好")
    assert len(ins) == 2 and ins[0] == "好" and is_hanzi(ins[1])
    assert one(syn, "delete", "好") == ""
    only_swap = Synthesizer(syn.features, AttackConfig(transforms=("swap",)))
    attacked, edits = only_swap.attack("手机很好用啊", seed=1)
    assert sorted(attacked) == sorted("手机很好用啊") and attacked != "手机很好用啊"
    for e in edits:
        assert e.replacement == e.original[::-1] and attacked[e.position : e.position + 2] == e.replacement


def test_rules_share_minimum_and_short_texts(syn):
    assert syn.attack("很好用", seed=0) == ("很好用", [])  # below 6 characters: untouched
    assert syn.num_edits("很好用的手机") == 2  # 15% of 6 rounds to 1; at least 2
    assert syn.num_edits("好" * 40) == 6
    attacked, edits = syn.attack(TEXT, seed=3)
    assert len(edits) == syn.num_edits(TEXT) and attacked != TEXT
    assert len({e.position for e in edits}) == len(edits)
    assert all(is_hanzi(e.original[0]) for e in edits)


def test_deterministic_under_a_seed(syn):
    assert syn.attack(TEXT, seed=7) == syn.attack(TEXT, seed=7)
    assert len({syn.attack(TEXT, seed=s)[0] for s in range(6)}) > 1
    # the draw depends only on (text, seed): a fresh synthesiser gives the same
    assert Synthesizer(syn.features).attack(TEXT, seed=7) == syn.attack(TEXT, seed=7)


def test_preferred_positions_are_attacked_first(syn):
    hanzi = [i for i, ch in enumerate(TEXT) if is_hanzi(ch)]
    prefer = [TEXT.index("，"), *hanzi[::-1]]  # a comma cannot be attacked: it is passed over
    attacked, edits = syn.attack(TEXT, seed=3, prefer=prefer)
    assert sorted(e.position for e in edits) == sorted(hanzi[::-1][: syn.num_edits(TEXT)])
    assert (attacked, edits) == syn.attack(TEXT, seed=3, prefer=prefer)
    # fewer preferred positions than edits: the rest are drawn as without a preference
    _, some = syn.attack(TEXT, seed=3, prefer=[hanzi[0]])
    assert hanzi[0] in {e.position for e in some} and len(some) == syn.num_edits(TEXT)


def test_every_transform_is_used_by_the_mix(syn):
    seen = {e.transform for s in range(60) for e in syn.attack(TEXT, seed=s)[1]}
    assert seen == set(TRANSFORMS)


def test_config_is_validated():
    with pytest.raises(ValueError, match="rate must lie in"):
        AttackConfig(rate=0)
    with pytest.raises(ValueError, match="unknown or empty"):
        AttackConfig(transforms=("typo",))
