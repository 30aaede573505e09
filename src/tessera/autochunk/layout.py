"""Lay a loop's output out for the einsum that reads it whole.

``einsum`` runs as a batched matmul: each operand is permuted to (batch dims, then the
rest) and each batch's matrix must have a unit stride in one of its two dims, or the CPU
kernel copies it first, inside itself. An operand read whole by a loop over slices of the
other one is copied again at every slice: the triangle multiplication's right-hand
projection ``b_jkc`` (batch dims b, c last in memory) is copied once per slice of ``a``, 1 GiB
per slice at 1424 residues; sliced in 16 rows at 384 residues the products take 12 times as
long as the one whole einsum. A loop writes its output into a buffer it allocates, so it can
allocate it with those batch dims outermost in memory (the same values, other strides): then
no slice copies it, and sliced products run faster than the whole one (measured 0.28 s
against 0.44 s at 384 residues, one thread).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from tessera.autochunk.loops import Region

aten = torch.ops.aten


def einsum_layout(einsum: Node, operand: Node) -> tuple[int, ...] | None:
    """The memory order (outermost dim first) in which ``einsum`` reads ``operand`` without a
    copy: its batch dims (letters in the output and in the other operand) first, the rest in
    their order. None when that is the operand's own order or the equation is not a product
    of two operands."""
    equation, operands = einsum.args[0], einsum.args[1]
    if "." in equation or len(operands) != 2 or sum(o is operand for o in operands) != 1:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    specs = inputs.split(",")
    mine = 0 if operands[0] is operand else 1
    spec, other = specs[mine], specs[1 - mine]
    batch = [d for d, letter in enumerate(spec) if letter in output and letter in other]
    order = tuple(batch + [d for d in range(len(spec)) if d not in batch])
    return None if order == tuple(range(len(spec))) else order


def output_layouts(regions: list[Region], outputs: set[Node]) -> dict[Node, tuple[int, ...]]:
    """For each loop (by its end node) whose output every reader is an einsum reading it whole,
    and that agree on one order: that memory order. Loops that write into an input (which has
    its own layout) and graph outputs (the caller sees their strides) keep the default."""
    owner = {n: r for r in regions for n in r.dims if n not in r.copies}
    layouts = {}
    for region in regions:
        end = region.end
        if region.into is not None or end in outputs or not end.users:
            continue
        wanted = set()
        for user in end.users:
            reader = owner.get(user)
            whole = reader is None or reader.reads[user].get(end, 0) is None
            is_einsum = user.op == "call_function" and user.target == aten.einsum.default
            wanted.add(einsum_layout(user, end) if is_einsum and whole else None)
        if len(wanted) == 1 and None not in wanted:
            layouts[end] = wanted.pop()
    return layouts


def laid_out(like: torch.Tensor, shape: list[int], order: tuple[int, ...] | None) -> torch.Tensor:
    """An empty tensor of ``shape`` (dtype and device of ``like``) whose dims lie in memory in
    ``order``, outermost first; contiguous without one."""
    if order is None:
        return like.new_empty(shape)
    inverse = [order.index(d) for d in range(len(order))]
    return like.new_empty([shape[d] for d in order]).permute(inverse)
