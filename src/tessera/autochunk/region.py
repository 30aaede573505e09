"""Grow a region backwards from its last node along one dimension.

Starting from ``end`` sliced along ``d``, every input the slice needs is asked (via
``rules.input_dims``) which of its own dimensions to slice. A node joins the region when
it can itself be computed in slices and every one of its users is in the region with the
same dimension; otherwise it stays outside, is computed whole before the loop, and is
sliced (or passed whole) where the region reads it. A second variant also recomputes the
region's cheap inputs (pointwise ops, norms, views of values computed outside) in slices
inside the loop, so their whole values can die before it: a layer norm read by a projection
that must stay whole and by the sliced branch then costs one pair-sized tensor less. The
planner keeps whichever variant its memory estimate prefers. Growing is greedy: the largest such
region holds the most intermediates at slice size, and costs no recomputation (every node
still runs once, in pieces).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from tessera.autochunk.loops import Region
from tessera.autochunk.memory import MemoryModel
from tessera.autochunk.rules import CHEAP_OPS, input_dims, shape


def _side_effect(node: Node) -> bool:
    target = node.target
    schema = getattr(target, "_schema", None)
    return node.op == "call_function" and (
        (schema is not None and schema.is_mutable) or (schema is None and node.is_impure())
    )


def _cheap(node: Node) -> bool:
    """Ops worth computing twice (whole outside, in slices inside) to shorten a whole value's life."""
    target = node.target
    if target is operator.getitem or target in CHEAP_OPS:
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def build_region(
    model: MemoryModel, end: Node, d: int, taken: set[Node], pinned: frozenset[Node] = frozenset()
) -> list[Region]:
    """The largest region ending at ``end`` sliced along ``d``, and the same region also
    recomputing its cheap inputs; empty if ``end`` cannot be sliced along ``d``. ``taken``
    nodes belong to other regions; ``pinned`` ones are read whole by them and must stay
    outside this one too."""
    out = shape(end)
    if out is None or end.op != "call_function" or end in taken or out[d] < 2:
        return []
    length = out[d]
    dims: dict[Node, int] = {end: d}
    answers: dict[Node, dict[Node, int | None]] = {}
    outside: set[Node] = set()
    queue = [end]
    while queue:
        node = queue.pop()
        answer = input_dims(node, dims[node])
        per_arg: dict[Node, int | None] = {}
        if answer is not None:
            for arg, dim in answer:
                if arg in per_arg and per_arg[arg] != dim:
                    answer = None  # one op reading the same input along two dims
                    break
                if dim is not None and shape(arg)[dim] != length:
                    answer = None
                    break
                per_arg[arg] = dim
        if answer is None:
            if node is end:
                return []
            outside.add(node)
            continue
        answers[node] = per_arg
        for arg, dim in per_arg.items():
            if arg.op != "call_function" or arg in taken:
                continue
            if dim is None:
                outside.add(arg)
            elif arg in dims:
                if dims[arg] != dim:
                    outside.add(arg)
            else:
                dims[arg] = dim
                queue.append(arg)
    members = {n for n in answers if n not in outside}
    changed = True
    while changed:
        changed = False
        for node in list(members):
            orphan = node.target is operator.getitem and node.args[0] not in members  # reads a list
            needed_outside = node in pinned or any(user not in members for user in node.users)
            if node is not end and (orphan or needed_outside):
                members.discard(node)
                changed = True
    first = min(model.order[n] for n in members)
    for node in model.nodes[first : model.order[end]]:
        if node not in members and _side_effect(node):
            return []
    region = _region(model, end, length, {n: dims[n] for n in members}, answers, set())
    variants = [region]
    copies = {}
    uses: dict[Node, set] = {}
    for arg, dim in region.inputs:
        uses.setdefault(arg, set()).add(dim)
    for arg, dim in region.inputs:
        if dim is None or uses[arg] != {dim} or arg.op != "call_function" or arg in taken or not _cheap(arg):
            continue
        if arg.target is operator.getitem:
            continue
        answer = input_dims(arg, dim)
        if answer is not None and all(d is None or shape(a)[d] == length for a, d in answer):
            copies[arg] = (dim, dict(answer))
    if copies:
        dims = dict(region.dims) | {n: d for n, (d, _) in copies.items()}
        answers = answers | {n: a for n, (_, a) in copies.items()}
        variants.append(_region(model, end, length, dims, answers, set(copies)))
    return variants


def _region(model, end, length, dims, answers, copies) -> Region:
    inputs = []
    for node in dims:
        for arg, dim in answers[node].items():
            if arg not in dims and (arg, dim) not in inputs:
                inputs.append((arg, dim))
    inputs.sort(key=lambda pair: model.order[pair[0]])
    reads = {n: answers[n] for n in dims}
    return Region(end=end, dims=dims, inputs=inputs, length=length, copies=copies, reads=reads)
