import json

import numpy as np
import pytest

from tessera.apps.rocbert.features import (
    SPECIALS,
    build_vocab,
    gb2312_level1,
    glyph_vectors,
    initial,
    load_features,
    toneless_pinyin,
)


def test_pinyin_is_toneless_and_initials_split():
    assert toneless_pinyin("好") == "hao" and toneless_pinyin("中") == "zhong"
    assert toneless_pinyin("a") is None and toneless_pinyin("，") is None
    assert (initial("zhong"), initial("hao"), initial("ai")) == ("zh", "h", "a")


def test_gb2312_level1_is_the_3755_common_characters():
    chars = gb2312_level1()
    assert len(chars) == 3755 and chars[0] == "啊" and chars[-1] == "座"


def test_vocab_has_syllables_letters_and_unique_tokens():
    tokens, pinyin = build_vocab("好号，中")
    assert tokens[: len(SPECIALS)] == list(SPECIALS) and len(set(tokens)) == len(tokens)
    assert {"hao", "zhong", "h", "zh", "##q", "，"} <= set(tokens)
    assert pinyin["好"] == pinyin["号"] == pinyin["hao"] == "hao"


def test_files_are_what_the_tokenizer_reads(features):
    root = features.root
    vocab = (root / "vocab.txt").read_text(encoding="utf8").splitlines()
    shape = json.loads((root / "word_shape.json").read_text(encoding="utf8"))
    pron = json.loads((root / "word_pronunciation.json").read_text(encoding="utf8"))
    assert set(shape) == set(pron) == set(vocab)
    assert features.glyphs.shape[0] == len(vocab) and max(shape.values()) == len(vocab) - 1
    assert load_features(root).tokens == features.tokens


def test_tokenizer_round_trips_and_ids_line_up(features):
    tok = features.tokenizer()
    text = "这个手机很好用，hao东西"
    enc = tok(text)
    tokens = tok.convert_ids_to_tokens(enc["input_ids"])
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and "[UNK]" not in tokens
    assert tok.decode(enc["input_ids"], skip_special_tokens=True).replace(" ", "") == text
    assert len(enc["input_ids"]) == len(enc["input_shape_ids"]) == len(enc["input_pronunciation_ids"])
    for t, s, p in list(zip(tokens, enc["input_shape_ids"], enc["input_pronunciation_ids"], strict=True))[
        1:-1
    ]:
        assert s == features.tokens.index(t) and p == features.pronunciation[t]
    ids = dict(zip(tokens, enc["input_pronunciation_ids"], strict=True))
    assert ids["好"] == ids["hao"]  # a character and its written-out pinyin sound the same
    assert ids["好"] != ids["用"]


def test_glyph_vectors_put_look_alikes_close(features):
    g = features.glyphs
    row = {t: g[i] for i, t in enumerate(features.tokens)}
    assert not g[: len(SPECIALS)].any()  # no glyph for [PAD], [CLS], ...
    assert np.linalg.norm(row["晴"] - row["睛"]) < np.linalg.norm(row["晴"] - row["森"])
    assert np.linalg.norm(row["木"] - row["本"]) < np.linalg.norm(row["木"] - row["请"])


def test_shape_dim_beyond_the_glyphs_is_refused():
    with pytest.raises(ValueError, match="shape_dim=8 exceeds the 3 drawn glyphs"):
        glyph_vectors(np.eye(4, 16, dtype=np.float32)[:, :] * [[1], [1], [1], [0]], 8)
