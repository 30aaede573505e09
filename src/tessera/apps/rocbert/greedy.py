"""A black-box greedy attack with a query budget (the family ROCBERT is evaluated under, e.g.
TextFooler / PWWS-style): rank the characters by how much deleting each lowers the model's
probability of the true label, then walk them in that order, trying the synthesiser's
substitutes at each and keeping the one that lowers it most, until the prediction flips, the
edit budget (ROCBERT's 15 %, at least 2) or the query budget is spent. Only the model's output
probabilities are used, never its gradients."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tessera.apps.rocbert.attacks import Synthesizer
from tessera.apps.rocbert.features import is_hanzi

PER_TRANSFORM = 3  # candidates tried per transform and position (homophones/look-alikes have many)


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


def greedy_attack(
    proba: Callable[[list[str]], torch.Tensor],
    text: str,
    label: int,
    syn: Synthesizer,
    *,
    query_budget: int = 200,
    seed: int = 0,
) -> GreedyResult:
    """``proba(texts)`` -> [len(texts), classes] probabilities (one query per text)."""
    pieces = list(text)
    positions = [i for i, ch in enumerate(text) if is_hanzi(ch)]
    base = proba([text])[0]
    queries = 1
    if int(base.argmax()) != label:
        return GreedyResult(True, queries, text, [])  # already wrong: nothing to attack
    limit = syn.num_edits(text)  # 0 below 6 characters: ROCBERT leaves short texts alone
    if limit == 0:
        return GreedyResult(False, queries, text, [])
    left_out = ["".join(pieces[:i] + pieces[i + 1 :]) for i in positions][: max(0, query_budget - queries)]
    importance = proba(left_out)[:, label] if left_out else torch.empty(0)
    queries += len(left_out)
    order = [positions[i] for i in torch.argsort(importance).tolist()]  # biggest drop first
    edits, best_p = [], float(base[label])
    for i in order:
        if len(edits) >= limit or queries >= query_budget:
            break
        # seeded by (text, position): every model meets the same substitutes at a position,
        # whichever positions its own ranking visited first
        rng = random.Random(f"greedy\x00{seed}\x00{text}\x00{i}")
        options = candidates(syn, text[i], rng)[: query_budget - queries]
        if not options:
            continue
        trial = ["".join(pieces[:i] + [r] + pieces[i + 1 :]) for _, r in options]
        p = proba(trial)
        queries += len(options)
        j = int(torch.argmin(p[:, label]))
        if float(p[j, label]) >= best_p:
            continue  # no substitute here helps: leave the character alone
        best_p, pieces[i] = float(p[j, label]), options[j][1]
        edits.append((i, *options[j]))
        if int(p[j].argmax()) != label:
            return GreedyResult(True, queries, "".join(pieces), edits)
    return GreedyResult(False, queries, "".join(pieces), edits)
