"""Recognising a contraction in the IR: the axes of ``out[...] += A[...] * B[...]`` fall into
batch (in the output and both operands), M (output and A), N (output and B: the vector
side, so B is the operand holding the output's innermost axis) and K (reduced). Each
operand's offset then splits into a part per group, which the code generator turns into
offset tables (and guard tables for dimensions that can leave their bounds)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.kernels.ir import Access, Affine, Axis, BinOp, Operator, drop_unit_axes


class NotTensorizable(ValueError):
    """The operator is not a contraction the micro-kernel can run (use a LoopSchedule)."""


@dataclass(frozen=True)
class Contraction:
    op: Operator  # with extent-1 axes dropped
    a: Access
    b: Access
    batch: tuple[Axis, ...]
    m: tuple[Axis, ...]
    n: tuple[Axis, ...]
    k: tuple[Axis, ...]

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return tuple(math.prod(a.extent for a in g) for g in (self.batch, self.m, self.n, self.k))

    def part(self, acc: Access, group: str, *, const: bool = False) -> Affine:
        """The offset of ``acc`` restricted to one axis group."""
        return acc.offset().restrict({a.name for a in getattr(self, group)}, const=const)

    def index_part(self, acc: Access, dim: int, group: str, *, const: bool = False) -> Affine:
        return acc.index[dim].restrict({a.name for a in getattr(self, group)}, const=const)

    def scaled_flat(self, affine: Affine, group: str) -> int | None:
        """s when ``affine`` == s * (row-major flat index of the group's axes), else None."""
        axes = getattr(self, group)
        if not axes:
            return 1
        step, scale = 1, None
        for ax in reversed(axes):
            c = affine.coeff(ax.name)
            if scale is None:
                scale = c
            if c != scale * step or c == 0:
                return None
            step *= ax.extent
        return scale if len(affine.coeffs) == len(axes) and affine.const == 0 else None


def _plain_output(op: Operator) -> list[str]:
    names = []
    for idx, size in zip(op.output.index, op.output.tensor.shape, strict=True):
        if not idx.coeffs and idx.const == 0 and size == 1:
            continue
        if len(idx.coeffs) != 1 or idx.coeffs[0][1] != 1 or idx.const != 0:
            raise NotTensorizable(f"{op.name}: output index {idx} is not a plain axis")
        names.append(idx.coeffs[0][0])
    if len(set(names)) != len(names):
        raise NotTensorizable(f"{op.name}: an axis indexes two output dimensions")
    return names


def analyse(op: Operator, *, fuse_n: bool = True) -> Contraction:
    """``fuse_n``: output axes read by B alone all join N (one wide GEMM, e.g. a conv's images
    and pixels); otherwise only the innermost run of them does and the others become batch
    loops (each C block then has contiguous columns)."""
    op = drop_unit_axes(op)
    body = op.body
    if not (isinstance(body, BinOp) and body.op == "*" and isinstance(body.lhs, Access) and isinstance(body.rhs, Access)):
        raise NotTensorizable(f"{op.name}: the body is not a product of two tensor reads")
    out_axes = _plain_output(op)
    if not out_axes:
        raise NotTensorizable(f"{op.name}: the output has no axis")
    last = out_axes[-1]
    first, second = body.lhs, body.rhs
    if (last in first.axes) == (last in second.axes):
        raise NotTensorizable(f"{op.name}: the innermost output axis {last!r} must be read by exactly one operand")
    a, b = (second, first) if last in first.axes else (first, second)
    by_name = {ax.name: ax for ax in op.axes}
    b_only = [n for n in out_axes if n in b.axes and n not in a.axes]
    if not fuse_n:
        suffix = []
        for name in reversed(out_axes):
            if name not in b_only:
                break
            suffix.insert(0, name)
        b_only = suffix
    batch = tuple(by_name[n] for n in out_axes if n in b.axes and n not in b_only)
    m = tuple(by_name[n] for n in out_axes if n in a.axes and n not in b.axes)
    n_ = tuple(by_name[n] for n in b_only)
    if len(batch) + len(m) + len(n_) != len(out_axes):
        raise NotTensorizable(f"{op.name}: an output axis is read by neither operand")
    if not m:
        raise NotTensorizable(f"{op.name}: no axis belongs to A alone (M is empty)")
    k = tuple(ax for ax in op.axes if ax.name in op.reduction_axes)
    if not k:
        raise NotTensorizable(f"{op.name}: nothing is reduced")
    extents = op.extents
    if a.guarded_dims(extents):
        raise NotTensorizable(f"{op.name}: operand {a.tensor.name} reads out of bounds (only B may be padded)")
    if op.output.guarded_dims(extents):
        raise NotTensorizable(f"{op.name}: the output is written out of bounds")
    if len(b.guarded_dims(extents)) > 4:
        raise NotTensorizable(f"{op.name}: more than 4 padded dimensions")
    return Contraction(op=op, a=a, b=b, batch=batch, m=m, n=n_, k=k)
