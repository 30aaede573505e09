"""Black-box greedy attacks with a query budget and an edit budget (the family ROCBERT is
evaluated under, e.g. TextFooler / PWWS-style): rank the text's units (characters or words) by
how much deleting each lowers the model's probability of the true label, then walk them in that
order, trying the attack's substitutes at each and keeping the one that lowers it most, until
the prediction flips, the edit budget or the query budget is spent. Only the model's output
probabilities are used, never its gradients.

Three attacks share the walk (``greedy_walk``) and both budgets: the edit budget is
ROCBERT's 15 % of the text's characters, at least 2, none under 6 characters (``edit_budget``),
counted in characters of the clean text replaced, whatever the unit.

- ``greedy_attack``: substitutes from the training synthesiser (``attacks.Synthesizer``), so
  in-distribution for a model trained on its copies;
- ``char_attack``: homophones and look-alikes from tables built without the synthesiser's
  sources (``independent.IndependentTables``);
- ``word_attack``: synonyms of jieba's words from the Cilin thesaurus.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tessera.apps.rocbert.attacks import AttackConfig, Synthesizer
from tessera.apps.rocbert.features import is_hanzi

PER_TRANSFORM = 3  # candidates tried per transform and position (homophones/look-alikes have many)
# the independent character attack: homophones drawn from the most frequent few, and the nearest
# look-alikes; 8 substitutes a position, about half of what the synthesiser offers (~15)
PER_TABLE = 4
HOMOPHONE_DRAW = 12
SYNONYMS_PER_WORD = 8  # drawn from the word's thesaurus synonyms

Proba = Callable[[list[str]], torch.Tensor]
# (start, end, rng) -> (kind, replacement) substitutes for the clean text's span [start, end)
Propose = Callable[[int, int, random.Random], list[tuple[str, str]]]


@dataclass(frozen=True)
class GreedyResult:
    success: bool  # the prediction left the true label (within the budgets)
    queries: int
    text: str
    edits: list[tuple[int, str, str]]  # (position in the clean text, transform, replacement)


def candidates(syn: Synthesizer, c: str, rng: random.Random) -> list[tuple[str, str]]:
    """(transform, replacement) pairs the synthesiser offers for character c."""
    out = []
    pools = {
        "homophone": syn.homophones(c),
        "lookalike": syn.lookalikes(c),
        "same_component": syn.same_component(c),
    }
    for name in syn.config.transforms:
        if name in pools:
            out += [(name, r) for r in rng.sample(pools[name], min(PER_TRANSFORM, len(pools[name])))]
        elif name != "swap":  # a swap changes two positions; the greedy walk edits one at a time
            r = syn.transform(name, c, rng)
            if r is not None:
                out.append((name, r))
    return out


def edit_budget(text: str, config: AttackConfig | None = None) -> int:
    """How many of the clean text's characters an attack may replace: ROCBERT's rule (15 %, at
    least 2; texts under 6 characters are left alone), the synthesiser's ``num_edits``."""
    config = config or AttackConfig()
    if len(text) < config.min_length:
        return 0
    return max(config.min_edits, round(config.rate * len(text)))


def greedy_walk(
    proba: Proba,
    text: str,
    label: int,
    units: list[tuple[int, int]],
    propose: Propose,
    *,
    edit_limit: int,
    query_budget: int,
    key: str,
) -> GreedyResult:
    """The greedy walk over ``units`` (disjoint (start, end) spans of ``text``); a unit of n
    characters spends n of ``edit_limit``. ``key`` seeds each unit's substitutes by (key, text,
    start), so every model meets the same substitutes at a unit, whatever order it visits in."""
    if query_budget < 1:
        raise ValueError(f"query_budget must be >= 1, got {query_budget}")
    pieces = list(text)
    base = proba([text])[0]
    queries = 1
    if int(base.argmax()) != label:
        return GreedyResult(True, queries, text, [])  # already wrong: nothing to attack
    if edit_limit == 0 or not units:
        return GreedyResult(False, queries, text, [])
    left_out = ["".join(pieces[:s] + pieces[e:]) for s, e in units][: max(0, query_budget - queries)]
    importance = proba(left_out)[:, label] if left_out else torch.empty(0)
    queries += len(left_out)
    order = [units[i] for i in torch.argsort(importance).tolist()]  # biggest drop first
    edits, used, best_p = [], 0, float(base[label])
    for s, e in order:
        if used >= edit_limit or queries >= query_budget:
            break
        if used + (e - s) > edit_limit:
            continue  # a word longer than what is left of the budget
        options = propose(s, e, random.Random(f"{key}\x00{text}\x00{s}"))[: query_budget - queries]
        if not options:
            continue
        trial = ["".join(pieces[:s] + [r] + pieces[e:]) for _, r in options]
        p = proba(trial)
        queries += len(options)
        j = int(torch.argmin(p[:, label]))
        if float(p[j, label]) >= best_p:
            continue  # no substitute here helps: leave the unit alone
        best_p, pieces[s:e] = float(p[j, label]), [options[j][1]] + [""] * (e - s - 1)
        edits.append((s, *options[j]))
        used += e - s
        if int(p[j].argmax()) != label:
            return GreedyResult(True, queries, "".join(pieces), edits)
    return GreedyResult(False, queries, "".join(pieces), edits)


def greedy_attack(
    proba: Proba,
    text: str,
    label: int,
    syn: Synthesizer,
    *,
    query_budget: int = 200,
    seed: int = 0,
) -> GreedyResult:
    """The in-distribution attack: the synthesiser's substitutes at each Chinese character.
    ``proba(texts)`` -> [len(texts), classes] probabilities (one query per text)."""
    units = [(i, i + 1) for i, ch in enumerate(text) if is_hanzi(ch)]
    return greedy_walk(
        proba,
        text,
        label,
        units,
        lambda s, e, rng: candidates(syn, text[s], rng),
        edit_limit=syn.num_edits(text),
        query_budget=query_budget,
        key=f"greedy\x00{seed}",
    )


def char_candidates(tables, c: str, rng: random.Random) -> list[tuple[str, str]]:
    """(kind, replacement): up to PER_TABLE homophones drawn from c's HOMOPHONE_DRAW most
    frequent ones, then c's PER_TABLE nearest look-alikes (none repeated)."""
    sounds = tables.homophones(c)[:HOMOPHONE_DRAW]
    out = [("homophone", h) for h in rng.sample(sounds, min(PER_TABLE, len(sounds)))]
    taken = {r for _, r in out}
    out += [("lookalike", g) for g in tables.lookalikes(c, PER_TABLE + len(taken)) if g not in taken][
        :PER_TABLE
    ]
    return out


def char_attack(
    proba: Proba, text: str, label: int, tables, *, query_budget: int = 200, seed: int = 0
) -> GreedyResult:
    """Homophones and look-alikes from ``tables`` (``independent.IndependentTables``) at each
    Chinese character; the same budgets as ``greedy_attack``."""
    units = [(i, i + 1) for i, ch in enumerate(text) if is_hanzi(ch)]  # every one has look-alikes
    return greedy_walk(
        proba,
        text,
        label,
        units,
        lambda s, e, rng: char_candidates(tables, text[s], rng),
        edit_limit=edit_budget(text),
        query_budget=query_budget,
        key=f"char\x00{seed}",
    )


def word_attack(
    proba: Proba, text: str, label: int, tables, *, query_budget: int = 200, seed: int = 0
) -> GreedyResult:
    """Thesaurus synonyms (``tables.synonyms``) for each of jieba's words that has any, up to
    SYNONYMS_PER_WORD drawn per word; a word of n characters spends n of the edit budget."""
    from tessera.apps.rocbert.independent import words

    units = [(s, e) for s, e in words(text) if tables.synonyms(text[s:e])]

    def propose(s: int, e: int, rng: random.Random) -> list[tuple[str, str]]:
        found = tables.synonyms(text[s:e])
        return [("synonym", w) for w in rng.sample(found, min(SYNONYMS_PER_WORD, len(found)))]

    return greedy_walk(
        proba,
        text,
        label,
        units,
        propose,
        edit_limit=edit_budget(text),
        query_budget=query_budget,
        key=f"word\x00{seed}",
    )
