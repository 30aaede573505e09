"""ROCBERT's three views of a character (semantic, phonetic, visual), written as the files
transformers' ``RoCBertTokenizer`` reads: ``vocab.txt``, ``word_shape.json`` (token -> shape
id) and ``word_pronunciation.json`` (token -> pronunciation id).

- Semantic: one vocabulary entry per character (the shipped corpora plus GB2312 level 1, so
  that homophones and look-alikes an attacker picks are in the vocabulary), plus the latin
  tokens a pinyin attack writes: every toneless syllable and initial as a whole token, and
  ``a``..``z`` / ``##a``..``##z`` so that any shuffled letters still tokenize.
- Phonetic: toneless pinyin (``pypinyin``, Style.NORMAL). A character and its syllable
  written out in latin letters ("好" and "hao") share one pronunciation id, which is what
  lets the model see through pinyin and homophone attacks.
- Visual: every token rendered with WenQuanYi Micro Hei (the ``paperang-p2-fonts-cjk``
  wheel on PyPI ships ``wqy-microhei.ttc``; ``pip install`` is all a fresh machine needs),
  then PCA (scikit-learn) to ``shape_dim`` numbers. Shape id = vocabulary id; the vectors
  initialise ``RoCBertModel``'s shape embedding (``init_shape_embedding``), so look-alike
  glyphs are near each other; the recipe keeps that table frozen (``RocbertSize.freeze_shape``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"


def font_path() -> Path:
    """The CJK font file the glyphs are drawn with (from the paperang-p2-fonts-cjk wheel)."""
    try:
        return Path(str(files("paperang_p2_fonts_cjk").joinpath("fonts/wqy-microhei.ttc")))
    except ModuleNotFoundError:
        raise ValueError(
            "no CJK font: pip install paperang-p2-fonts-cjk (or tessera[rocbert]) for wqy-microhei.ttc"
        ) from None


def is_hanzi(ch: str) -> bool:
    return len(ch) == 1 and "\u4e00" <= ch <= "\u9fff"


def need(module: str, what: str):
    """``module`` imported, or a one-line error saying which package gives ``what``."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        package = module.replace("_", "-")
        raise ValueError(f"no {what}: pip install {package} (or 'tessera[rocbert]')") from None


def toneless_pinyin(ch: str) -> str | None:
    """The toneless pinyin of one Chinese character ('好' -> 'hao'); None for anything else."""
    pypinyin = need("pypinyin", "pinyin")
    Style, lazy_pinyin = pypinyin.Style, pypinyin.lazy_pinyin

    if not is_hanzi(ch):
        return None
    syllable = lazy_pinyin(ch, style=Style.NORMAL, errors="ignore")
    return syllable[0] if syllable and syllable[0].isalpha() else None


def initial(syllable: str) -> str:
    """The pinyin initial ('hao' -> 'h', 'zhong' -> 'zh'); a syllable without one gives its first letter."""
    for two in ("zh", "ch", "sh"):
        if syllable.startswith(two):
            return two
    return syllable[0]


def gb2312_level1() -> list[str]:
    """The 3755 common characters of GB2312 level 1 (rows 16-55), in the standard's order."""
    chars = []
    for row in range(0xB0, 0xD8):
        for cell in range(0xA1, 0xFF):
            try:
                chars.append(bytes([row, cell]).decode("gb2312"))
            except UnicodeDecodeError:
                continue  # row 55 ends early
    return [c for c in chars if is_hanzi(c)]


def corpus_chars(texts: Iterable[str], min_count: int = 1) -> list[str]:
    """The characters of ``texts`` (Chinese, punctuation, symbols; not latin letters or digits,
    which the vocabulary always has) seen at least ``min_count`` times, most frequent first."""
    counts = Counter(c for text in texts for c in text.lower() if not c.isspace())
    skip = set(LETTERS + DIGITS)
    return [c for c, n in counts.most_common() if n >= min_count and c not in skip]


def build_vocab(chars: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """Tokens in id order, and each token's pinyin (hanzi and whole syllables/initials)."""
    chars = list(dict.fromkeys(c for c in chars if len(c) == 1 and not c.isspace()))
    hanzi = [c for c in chars if is_hanzi(c)]
    symbols = [c for c in chars if not is_hanzi(c)]
    pinyin = {c: p for c in hanzi if (p := toneless_pinyin(c))}
    syllables = sorted(set(pinyin.values()))
    initials = sorted({initial(s) for s in syllables})
    latin = list(LETTERS) + [f"##{c}" for c in LETTERS] + list(DIGITS) + [f"##{d}" for d in DIGITS]
    tokens = list(dict.fromkeys([*SPECIALS, *latin, *initials, *syllables, *symbols, *hanzi]))
    pinyin.update({t: t for t in (*initials, *syllables)})
    return tokens, pinyin


def pronunciation_ids(tokens: list[str], pinyin: dict[str, str]) -> dict[str, int]:
    """Token -> id of its toneless syllable; tokens without pinyin get one id each after them.
    Id 0 is [PAD] (the embedding's padding row)."""
    sounds = sorted(set(pinyin.values()))
    ids = {s: i + len(SPECIALS) for i, s in enumerate(sounds)}
    out, nxt = {}, len(SPECIALS) + len(sounds)
    for i, t in enumerate(tokens):
        if i < len(SPECIALS):
            out[t] = i
        elif t in pinyin:
            out[t] = ids[pinyin[t]]
        else:
            out[t], nxt = nxt, nxt + 1
    return out


def render(tokens: list[str], px: int = 32) -> np.ndarray:
    """Each token drawn white on black, centred, in a px x px box: [len(tokens), px * px] in [0, 1]."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(str(font_path()), size=px - 4)
    out = np.zeros((len(tokens), px * px), dtype=np.float32)
    for i, token in enumerate(tokens):
        if token in SPECIALS:
            continue  # no glyph: their shape rows stay zero
        image = Image.new("L", (px, px), 0)
        ImageDraw.Draw(image).text(
            (px / 2, px / 2), token.removeprefix("##"), fill=255, font=font, anchor="mm"
        )
        out[i] = np.asarray(image, dtype=np.float32).reshape(-1) / 255.0
    return out


def glyph_vectors(pixels: np.ndarray, shape_dim: int, seed: int = 0) -> np.ndarray:
    """PCA of the rendered glyphs to ``shape_dim`` numbers per token, scaled to BERT's 0.02
    init so they sit beside the word embeddings; glyph-less rows (specials) stay zero."""
    from sklearn.decomposition import PCA

    drawn = pixels.any(axis=1)
    if shape_dim > int(drawn.sum()):
        raise ValueError(
            f"shape_dim={shape_dim} exceeds the {int(drawn.sum())} drawn glyphs; use a smaller one"
        )
    pca = PCA(n_components=shape_dim, random_state=seed).fit(pixels[drawn])
    vectors = np.zeros((len(pixels), shape_dim), dtype=np.float32)
    projected = pca.transform(pixels[drawn])
    vectors[drawn] = 0.02 * projected / projected.std()
    return vectors


@dataclass(frozen=True)
class Features:
    """What ``build_features`` wrote, loaded back: the tokenizer's three files plus the glyph
    vectors and each token's pinyin (which the attacks use)."""

    root: Path
    tokens: list[str]
    pinyin: dict[str, str]
    pronunciation: dict[str, int]
    glyphs: np.ndarray

    @property
    def hanzi(self) -> list[str]:
        return [t for t in self.tokens if is_hanzi(t)]

    def tokenizer(self):
        from transformers import RoCBertTokenizer

        return RoCBertTokenizer(
            vocab_file=str(self.root / "vocab.txt"),
            word_shape_file=str(self.root / "word_shape.json"),
            word_pronunciation_file=str(self.root / "word_pronunciation.json"),
        )

    @property
    def pronunciation_vocab_size(self) -> int:
        return max(self.pronunciation.values()) + 1


def build_features(
    chars: Iterable[str], out_dir: str | Path, *, shape_dim: int = 32, px: int = 32
) -> Features:
    """Write vocab.txt, word_shape.json, word_pronunciation.json, glyphs.npy and pinyin.json."""
    if shape_dim < 1 or px < 8:
        raise ValueError(f"need shape_dim >= 1 and px >= 8, got shape_dim={shape_dim}, px={px}")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    tokens, pinyin = build_vocab(chars)
    (root / "vocab.txt").write_text("".join(f"{t}\n" for t in tokens), encoding="utf8")
    shape = {t: i for i, t in enumerate(tokens)}
    (root / "word_shape.json").write_text(json.dumps(shape, ensure_ascii=False), encoding="utf8")
    pron = pronunciation_ids(tokens, pinyin)
    (root / "word_pronunciation.json").write_text(json.dumps(pron, ensure_ascii=False), encoding="utf8")
    (root / "pinyin.json").write_text(json.dumps(pinyin, ensure_ascii=False), encoding="utf8")
    np.save(root / "glyphs.npy", glyph_vectors(render(tokens, px), shape_dim))
    return load_features(root)


def load_features(root: str | Path) -> Features:
    root = Path(root)
    if not (root / "vocab.txt").exists():
        raise ValueError(f"{root} holds no features (vocab.txt); build them with build_features first")
    tokens = (root / "vocab.txt").read_text(encoding="utf8").splitlines()
    return Features(
        root=root,
        tokens=tokens,
        pinyin=json.loads((root / "pinyin.json").read_text(encoding="utf8")),
        pronunciation=json.loads((root / "word_pronunciation.json").read_text(encoding="utf8")),
        glyphs=np.load(root / "glyphs.npy"),
    )


def init_shape_embedding(model, features: Features) -> None:
    """Copy the glyph vectors into a RoCBert model's shape embedding (rows = shape ids)."""
    import torch

    embed = getattr(model, "roc_bert", model).embeddings.shape_embed
    if tuple(embed.weight.shape) != features.glyphs.shape:
        raise ValueError(
            f"shape embedding is {tuple(embed.weight.shape)} but the glyph vectors are {features.glyphs.shape}: "
            "set shape_vocab_size=len(tokens) and shape_embed_dim=shape_dim"
        )
    with torch.no_grad():
        embed.weight.copy_(torch.from_numpy(features.glyphs))
