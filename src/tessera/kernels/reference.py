"""A float64 interpreter of the IR: evaluates an operator straight from its definition (every
point of the domain, zero-padded reads, dropped out-of-range writes), independent of any
schedule or generated code. Tests compare every compiled kernel with it, and it with
torch's own float64 ops."""

from __future__ import annotations

import numpy as np

from tessera.kernels.ir import Access, BinOp, Const, Expr, Operator

MAX_POINTS = 20_000_000  # index arrays of this many points take about a GiB


def _index_grid(op: Operator) -> dict[str, np.ndarray]:
    shape = tuple(a.extent for a in op.axes)
    return {a.name: np.arange(a.extent).reshape([-1 if i == j else 1 for j in range(len(shape))])
            for i, a in enumerate(op.axes)}


def _indices(acc: Access, grid: dict[str, np.ndarray], shape: tuple[int, ...]):
    idx, ok = [], np.ones(shape, dtype=bool)
    for affine, size in zip(acc.index, acc.tensor.shape, strict=True):
        v = np.full(shape, affine.const, dtype=np.int64)
        for name, c in affine.coeffs:
            v = v + c * grid[name]
        ok &= (v >= 0) & (v < size)
        idx.append(np.clip(v, 0, size - 1))
    return tuple(idx), ok


def _eval(expr: Expr, arrays, grid, shape) -> np.ndarray:
    if isinstance(expr, Const):
        return np.full(shape, expr.value)
    if isinstance(expr, Access):
        idx, ok = _indices(expr, grid, shape)
        return np.where(ok, arrays[expr.tensor.name][idx], 0.0)
    assert isinstance(expr, BinOp)
    lhs, rhs = _eval(expr.lhs, arrays, grid, shape), _eval(expr.rhs, arrays, grid, shape)
    return lhs * rhs if expr.op == "*" else lhs + rhs


def evaluate(op: Operator, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The operator's output in float64, for inputs given by tensor name."""
    if op.points > MAX_POINTS:
        raise ValueError(f"{op.name} has {op.points} points; the reference handles at most {MAX_POINTS}")
    arrays = {}
    for t in op.inputs:
        if t.name not in inputs:
            raise ValueError(f"{op.name} needs input {t.name!r}")
        arrays[t.name] = np.asarray(inputs[t.name], dtype=np.float64).reshape(t.shape)
    shape = tuple(a.extent for a in op.axes)
    grid = _index_grid(op)
    values = np.broadcast_to(_eval(op.body, arrays, grid, shape), shape)
    idx, ok = _indices(op.output, grid, shape)
    out = np.zeros(op.output.tensor.shape)
    np.add.at(out, tuple(i[ok] for i in idx), values[ok])
    return out


def magnitude(op: Operator, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The same sum over |terms| (each input replaced by its absolute value): the scale of
    the floating-point error bound of a recursive sum, |err| <= gamma_n * sum |terms|."""
    return evaluate(op, {k: np.abs(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()})
