"""The operator IR: an operator is a loop nest over named axes whose body reads tensors
through affine accesses and accumulates into one output tensor.

Semantics (one rule for contractions, scatters and stencils alike): the output starts at
zero; for every point of the iteration domain (the box of all axes) the body's value is
added to the output element its access names. A read outside a tensor's bounds is zero
(zero padding), a write outside is dropped. So GEMM is ``C[m, n] += A[m, k] * B[k, n]``
over the box (m, n, k), a convolution reads its input at ``oh * stride + r - pad``, and a
col2im writes at such an index.

    m, n, k = Axis("m", 64), Axis("n", 32), Axis("k", 16)
    A, B, C = Tensor("A", (64, 16)), Tensor("B", (16, 32)), Tensor("C", (64, 32))
    op = Operator(name="gemm", axes=(m, n, k), output=C[m, n], body=A[m, k] * B[k, n])

Index expressions are affine in the axes (``Affine``); that is what lets the code
generators build offset tables, bounds guards and loop bounds from the accesses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED_DTYPES = ("float32",)


@dataclass(frozen=True)
class Affine:
    """sum(coeff * axis) + const; ``coeffs`` sorted by axis name, no zero coefficient."""

    coeffs: tuple[tuple[str, int], ...] = ()
    const: int = 0

    @staticmethod
    def of(value: AffineLike) -> Affine:
        if isinstance(value, Affine):
            return value
        if isinstance(value, Axis):
            return Affine(((value.name, 1),))
        if isinstance(value, int):
            return Affine((), value)
        raise TypeError(f"an index must be an Axis, an int or an affine expression, not {value!r}")

    def _combine(self, other: AffineLike, sign: int) -> Affine:
        o = Affine.of(other)
        merged = dict(self.coeffs)
        for name, c in o.coeffs:
            merged[name] = merged.get(name, 0) + sign * c
        return Affine(tuple(sorted((n, c) for n, c in merged.items() if c)), self.const + sign * o.const)

    def __add__(self, other: AffineLike) -> Affine:
        return self._combine(other, 1)

    __radd__ = __add__

    def __sub__(self, other: AffineLike) -> Affine:
        return self._combine(other, -1)

    def __rsub__(self, other: AffineLike) -> Affine:
        return Affine.of(other)._combine(self, -1)

    def __mul__(self, factor: int) -> Affine:
        if not isinstance(factor, int):
            raise TypeError(f"an index can only be scaled by an int, not {factor!r}")
        return Affine(tuple((n, c * factor) for n, c in self.coeffs if c * factor), self.const * factor)

    __rmul__ = __mul__

    def coeff(self, axis: str) -> int:
        return dict(self.coeffs).get(axis, 0)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.coeffs)

    def restrict(self, axes: set[str] | tuple[str, ...], *, const: bool = False) -> Affine:
        """The part over ``axes`` (plus the constant when ``const``)."""
        return Affine(tuple((n, c) for n, c in self.coeffs if n in axes), self.const if const else 0)

    def range(self, extents: dict[str, int]) -> tuple[int, int]:
        """Smallest and largest value over the box 0 <= axis < extent."""
        lo = hi = self.const
        for n, c in self.coeffs:
            span = c * (extents[n] - 1)
            lo, hi = lo + min(0, span), hi + max(0, span)
        return lo, hi

    def c(self, names: dict[str, str] | None = None) -> str:
        """C expression; ``names`` maps an axis to the C expression of its value."""
        names = names or {}
        parts = [f"{c}*({names.get(n, n)})" if c != 1 else f"({names.get(n, n)})" for n, c in self.coeffs]
        if self.const or not parts:
            parts.append(f"({self.const})")
        return "(" + " + ".join(parts) + ")"

    def __str__(self) -> str:
        parts = [n if c == 1 else f"{c}*{n}" for n, c in self.coeffs]
        if self.const or not parts:
            parts.append(str(self.const))
        return "+".join(parts).replace("+-", "-")


@dataclass(frozen=True)
class Axis:
    name: str
    extent: int

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"axis name {self.name!r} must be an identifier")
        if not isinstance(self.extent, int) or self.extent < 1:
            raise ValueError(f"axis {self.name!r} has extent {self.extent!r}; it must be an int >= 1")

    def __add__(self, other: AffineLike) -> Affine:
        return Affine.of(self) + other

    __radd__ = __add__

    def __sub__(self, other: AffineLike) -> Affine:
        return Affine.of(self) - other

    def __rsub__(self, other: AffineLike) -> Affine:
        return Affine.of(other) - Affine.of(self)

    def __mul__(self, factor: int) -> Affine:
        return Affine.of(self) * factor

    __rmul__ = __mul__


AffineLike = Affine | Axis | int


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"tensor name {self.name!r} must be an identifier")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"tensor {self.name!r} has dtype {self.dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
        if not self.shape or any(not isinstance(d, int) or d < 1 for d in self.shape):
            raise ValueError(f"tensor {self.name!r} has shape {self.shape!r}; every dimension must be an int >= 1")

    @property
    def strides(self) -> tuple[int, ...]:
        """Row-major (C-contiguous) element strides."""
        out, step = [], 1
        for d in reversed(self.shape):
            out.append(step)
            step *= d
        return tuple(reversed(out))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __getitem__(self, index) -> Access:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != len(self.shape):
            raise ValueError(f"tensor {self.name!r} has {len(self.shape)} dimensions, indexed with {len(index)}")
        return Access(self, tuple(Affine.of(i) for i in index))


@dataclass(frozen=True)
class Access:
    tensor: Tensor
    index: tuple[Affine, ...]

    @property
    def axes(self) -> set[str]:
        return {a for i in self.index for a in i.axes}

    def offset(self) -> Affine:
        """The element offset into the row-major tensor, as one affine expression."""
        total = Affine()
        for stride, idx in zip(self.tensor.strides, self.index, strict=True):
            total = total + idx * stride
        return total

    def guarded_dims(self, extents: dict[str, int]) -> tuple[int, ...]:
        """Dimensions whose index can leave [0, size) over the domain (they need a guard)."""
        out = []
        for d, (idx, size) in enumerate(zip(self.index, self.tensor.shape, strict=True)):
            lo, hi = idx.range(extents)
            if lo < 0 or hi >= size:
                out.append(d)
        return tuple(out)

    def __mul__(self, other: Expr) -> BinOp:
        return BinOp("*", self, _expr(other))

    def __rmul__(self, other: Expr) -> BinOp:
        return BinOp("*", _expr(other), self)

    def __add__(self, other: Expr) -> BinOp:
        return BinOp("+", self, _expr(other))

    def __radd__(self, other: Expr) -> BinOp:
        return BinOp("+", _expr(other), self)

    def __str__(self) -> str:
        return f"{self.tensor.name}[{', '.join(str(i) for i in self.index)}]"


@dataclass(frozen=True)
class Const:
    value: float

    def __str__(self) -> str:
        return repr(float(self.value))


@dataclass(frozen=True)
class BinOp:
    op: str  # "+" or "*"
    lhs: Expr
    rhs: Expr

    def __mul__(self, other: Expr) -> BinOp:
        return BinOp("*", self, _expr(other))

    def __add__(self, other: Expr) -> BinOp:
        return BinOp("+", self, _expr(other))

    def __str__(self) -> str:
        return f"({self.lhs} {self.op} {self.rhs})"


Expr = Access | Const | BinOp


def _expr(value) -> Expr:
    if isinstance(value, Access | Const | BinOp):
        return value
    if isinstance(value, int | float):
        return Const(float(value))
    raise TypeError(f"{value!r} is not an expression of the IR")


def accesses(expr: Expr) -> list[Access]:
    if isinstance(expr, Access):
        return [expr]
    if isinstance(expr, BinOp):
        return accesses(expr.lhs) + accesses(expr.rhs)
    return []


def is_product(expr: Expr) -> bool:
    """A product of accesses and constants: zero whenever any read is out of bounds."""
    if isinstance(expr, BinOp):
        return expr.op == "*" and is_product(expr.lhs) and is_product(expr.rhs)
    return True


def count_ops(expr: Expr) -> int:
    return 1 + count_ops(expr.lhs) + count_ops(expr.rhs) if isinstance(expr, BinOp) else 0


@dataclass(frozen=True)
class Operator:
    name: str
    axes: tuple[Axis, ...]
    output: Access
    body: Expr

    def __post_init__(self):
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"operator {self.name!r} declares an axis twice: {names}")
        declared = set(names)
        tensors: dict[str, Tensor] = {}
        for acc in [self.output, *accesses(self.body)]:
            unknown = acc.axes - declared
            if unknown:
                raise ValueError(f"operator {self.name!r}: {acc} uses undeclared axes {sorted(unknown)}")
            seen = tensors.setdefault(acc.tensor.name, acc.tensor)
            if seen != acc.tensor:
                raise ValueError(f"operator {self.name!r}: two different tensors are named {acc.tensor.name!r}")
        if any(a.tensor.name == self.output.tensor.name for a in accesses(self.body)):
            raise ValueError(f"operator {self.name!r} reads its output {self.output.tensor.name!r}")

    @property
    def extents(self) -> dict[str, int]:
        return {a.name: a.extent for a in self.axes}

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        """Input tensors in order of first appearance in the body."""
        out: dict[str, Tensor] = {}
        for acc in accesses(self.body):
            out.setdefault(acc.tensor.name, acc.tensor)
        return tuple(out.values())

    @property
    def reduction_axes(self) -> tuple[str, ...]:
        used = self.output.axes
        return tuple(a.name for a in self.axes if a.name not in used)

    @property
    def points(self) -> int:
        return math.prod(a.extent for a in self.axes)

    @property
    def flops(self) -> int:
        """Arithmetic per point: the body's operations plus the accumulation."""
        return self.points * (count_ops(self.body) + 1)

    def signature(self) -> str:
        """Canonical text: equal for equal operators (used in cache keys)."""
        tensors = [self.output.tensor, *self.inputs]
        shapes = " ".join(f"{t.name}{list(t.shape)}:{t.dtype}" for t in tensors)
        axes = ",".join(f"{a.name}={a.extent}" for a in self.axes)
        return f"{self.name}[{axes}] {self.output} += {self.body} ; {shapes}"

    def __str__(self) -> str:
        return self.signature()


def _substitute(idx: Affine, drop: set[str]) -> Affine:
    return Affine(tuple((n, c) for n, c in idx.coeffs if n not in drop), idx.const)


def _subst_expr(expr: Expr, drop: set[str]) -> Expr:
    if isinstance(expr, Access):
        return Access(expr.tensor, tuple(_substitute(i, drop) for i in expr.index))
    if isinstance(expr, BinOp):
        return BinOp(expr.op, _subst_expr(expr.lhs, drop), _subst_expr(expr.rhs, drop))
    return expr


def drop_unit_axes(op: Operator) -> Operator:
    """The same operator without its extent-1 axes (each replaced by 0 in every index)."""
    drop = {a.name for a in op.axes if a.extent == 1}
    if not drop or len(drop) == len(op.axes):
        return op
    return Operator(
        name=op.name,
        axes=tuple(a for a in op.axes if a.name not in drop),
        output=_subst_expr(op.output, drop),
        body=_subst_expr(op.body, drop),
    )
