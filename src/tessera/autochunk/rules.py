"""How a slice along one output dimension of an op maps onto its inputs.

``input_dims(node, d)`` answers: if only a slice ``[start:start+n]`` of ``node``'s output
along dim ``d`` is wanted, which slice of each tensor input is enough? The answer is a list
of ``(input_node, dim)`` pairs: ``dim`` is the input's dimension to slice the same way, or
``None`` when the input is needed whole (it does not vary along ``d``: a weight, or a
broadcast dimension of size 1). ``None`` as the whole answer means the op cannot be
computed in slices along ``d`` — it reduces over ``d`` (softmax over it, a matmul's
contraction, a layer norm's normalized dims), mixes it with another dim (a reshape that
merges it), or is an op this table does not know. Unknown ops are never guessed at.

The graph is the pre-dispatch ATen graph ``make_fx(..., pre_dispatch=True)`` records, so the
vocabulary is small: ``linear``, ``addmm``, ``einsum``, ``scaled_dot_product_attention``, ``layer_norm``,
the view ops, and pointwise ops (found by their ``pointwise`` tag, not by a list).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch.fx import Node

aten = torch.ops.aten

Answer = list[tuple[Node, int | None]] | None

# Ops whose size list names the output shape: slicing the output along d changes entry d.
SIZE_LIST_OPS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.expand.default,
}

_IDENTITY = {
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten._to_copy.default,
    aten.type_as.default,
}
_SOFTMAX = {
    aten.softmax.int,
    aten._softmax.default,
    aten._safe_softmax.default,
    aten.log_softmax.int,
    aten._log_softmax.default,
}
_REDUCE = {
    aten.sum.dim_IntList,
    aten.mean.dim,
    aten.amax.default,
    aten.amin.default,
    aten.var.correction,
    aten.std.correction,
}


# Cheap enough to compute twice (see region.py): norms and views; pointwise ops by their tag.
CHEAP_OPS = {
    aten.layer_norm.default,
    aten.rms_norm.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.unflatten.int,
    aten.flatten.using_ints,
    aten.slice.Tensor,
    aten.select.int,
    aten.chunk.default,
    aten.split.Tensor,
    *SIZE_LIST_OPS,
    *_IDENTITY,
}


def shape(node) -> tuple[int, ...] | None:
    """The output shape of a node (of its first output for ops returning a list), or None."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    if isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val):
        val = val[0]
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _norm(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _broadcast(arg: Node, out_shape: Sequence[int], d: int) -> tuple[Node, int | None]:
    """Right-aligned broadcasting: the input's dim under output dim d, or None if absent/size 1."""
    s = shape(arg)
    k = d - (len(out_shape) - len(s))
    if k < 0 or s[k] == 1 != out_shape[d]:
        return arg, None
    return arg, k


def _tensor_args(args) -> list[Node]:
    return [a for a in args if isinstance(a, Node) and shape(a) is not None]


def _pointwise(node: Node, d: int) -> Answer:
    out = shape(node)
    tensors = _tensor_args(list(node.args) + list(node.kwargs.values()))
    return [_broadcast(a, out, d) for a in tensors]


def _view_source_dim(in_shape: Sequence[int], out_shape: Sequence[int], d: int) -> int | None:
    """The input dim that output dim d is, unchanged, in a reshape; None if it is merged or split."""
    before = 1
    for size in out_shape[:d]:
        before *= size
    acc = 1
    for e, size in enumerate(in_shape):
        if acc == before and size == out_shape[d]:
            return e
        acc *= size
    return None


def _sdpa(node: Node, d: int) -> Answer:
    """Every argument of the call stays on the sliced call (scale included); the mask is
    sliced with the queries or the batch. Not sliced: a causal call along the queries, a
    call with dropout (slices would draw other random masks than the whole does, as for
    ``aten.dropout``), and a grouped-query call (``enable_gqa``) along the heads (query head
    h reads key head h // group, so the same slice of both is wrong)."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    out = shape(node)
    rank = len(out)
    if d == rank - 1 or dropout:
        return None
    if d == rank - 3 and node.kwargs.get("enable_gqa", False):
        return None
    if d == rank - 2:  # query positions: keys/values whole, mask rows sliced
        if causal:
            return None  # is_causal ties query i to key i: a slice of queries would shift the diagonal
        answer = [(q, len(shape(q)) - 2), (k, None), (v, None)]
        if isinstance(mask, Node):
            answer.append(_broadcast(mask, out[:-1] + (shape(mask)[-1],), d))
        return answer
    answer = [_broadcast(t, out[:-2] + shape(t)[-2:], d) for t in (q, k, v)]
    if isinstance(mask, Node):
        full = out[:-1] + (shape(k)[-2],)
        answer.append(_broadcast(mask, full, d))
    return answer


def _einsum(node: Node, d: int) -> Answer:
    equation, operands = node.args[0], node.args[1]
    inputs, output = equation.replace(" ", "").split("->")
    if "." in equation:
        return None
    letter = output[d]
    answer = []
    for spec, operand in zip(inputs.split(","), operands, strict=True):
        answer.append((operand, spec.index(letter) if letter in spec else None))
    return answer


def _matmul(node: Node, d: int) -> Answer:
    a, b = node.args[:2]
    out = shape(node)
    sa, sb = shape(a), shape(b)
    if len(sa) < 2 or len(sb) < 2:
        return None
    rank = len(out)
    if d == rank - 2:
        return [(a, len(sa) - 2), (b, None)]
    if d == rank - 1:
        return [(a, None), (b, len(sb) - 1)]
    return [_broadcast(a, out[:-2] + sa[-2:], d), _broadcast(b, out[:-2] + sb[-2:], d)]


def input_dims(node: Node, d: int) -> Answer:  # noqa: C901 - one dispatch table
    """See the module docstring."""
    target, args = node.target, node.args
    out = shape(node)
    if out is None or not 0 <= d < len(out):
        return None
    if target is operator.getitem:
        return [(args[0], d)]
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return None
    first = args[0] if args else None
    rank_in = len(shape(first)) if shape(first) is not None else None
    if target in _IDENTITY:
        return [(first, d)]
    if target == aten.dropout.default:
        return [(first, d)] if not args[2] else None
    if torch.Tag.pointwise in target.tags:
        return _pointwise(node, d)
    if target == aten.linear.default:
        return [(first, d)] + [(w, None) for w in _tensor_args(args[1:])] if d < len(out) - 1 else None
    if target == aten.addmm.default:  # bias + mat1 @ mat2 (a Conv1D, a flattened linear)
        bias, mat1, mat2 = args[:3]
        rows, cols = (mat1, 0), (mat2, None)
        if d == 1:
            rows, cols = (mat1, None), (mat2, 1)
        return [_broadcast(bias, out, d), rows, cols] if isinstance(bias, Node) else [rows, cols]
    if target == aten.matmul.default or target == aten.bmm.default or target == aten.mm.default:
        return _matmul(node, d)
    if target == aten.einsum.default:
        return _einsum(node, d)
    if target == aten.scaled_dot_product_attention.default:
        return _sdpa(node, d)
    if target in (aten.layer_norm.default, aten.rms_norm.default):
        normalized = len(args[1])
        if d >= len(out) - normalized:
            return None
        return [(first, d)] + [(w, None) for w in _tensor_args(args[2:])]
    if target in _SOFTMAX:
        return [(first, d)] if _norm(args[1], len(out)) != d else None
    if target in _REDUCE:
        dims = args[1] if len(args) > 1 and args[1] is not None else list(range(rank_in))
        dims = {_norm(x, rank_in) for x in dims}
        keepdim = node.kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        kept = list(range(rank_in)) if keepdim else [i for i in range(rank_in) if i not in dims]
        e = kept[d]
        return None if e in dims else [(first, e)]
    if target in SIZE_LIST_OPS:
        if target == aten.expand.default:
            return [_broadcast(first, out, d)]
        e = _view_source_dim(shape(first), out, d)
        return None if e is None else [(first, e)]
    if target == aten.permute.default:
        return [(first, _norm(args[1][d], len(out)))]
    if target == aten.transpose.int:
        a, b = _norm(args[1], len(out)), _norm(args[2], len(out))
        return [(first, b if d == a else a if d == b else d)]
    if target == aten.t.default:
        return [(first, 1 - d if len(out) == 2 else d)]
    if target == aten.unsqueeze.default:
        k = _norm(args[1], len(out))
        return None if d == k else [(first, d if d < k else d - 1)]
    if target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        e = _view_source_dim(shape(first), out, d)
        return None if e is None else [(first, e)]
    if target == aten.unflatten.int:
        k = _norm(args[1], rank_in)
        width = len(args[2])
        if k <= d < k + width:
            return None
        return [(first, d if d < k else d - width + 1)]
    if target == aten.flatten.using_ints:
        start = _norm(args[1] if len(args) > 1 else 0, rank_in)
        end = _norm(args[2] if len(args) > 2 else -1, rank_in)
        if d < start:
            return [(first, d)]
        if d > start:
            return [(first, d + end - start)]
        merged = shape(first)[start : end + 1]
        inner = [i for i, size in enumerate(merged) if size != 1]
        return [(first, start + inner[0])] if len(inner) == 1 else None
    if target in (aten.slice.Tensor, aten.select.int):
        k = _norm(args[1], rank_in)
        if target == aten.select.int:
            return [(first, d if d < k else d + 1)]
        return None if d == k else [(first, d)]
    if target in (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default):
        k = _norm(args[2] if len(args) > 2 else node.kwargs.get("dim", 0), rank_in)
        return None if d == k else [(first, d)]
    if target == aten.unbind.int:
        k = _norm(args[1] if len(args) > 1 else 0, rank_in)
        return [(first, d if d < k else d + 1)]
    if target == aten.cat.default:
        k = _norm(args[1] if len(args) > 1 else 0, len(out))
        return None if d == k else [_broadcast(t, out, d) for t in args[0]]
    return None
