"""References for the generated kernels, in numpy slicing (independent of the C generator).

``apply_float64``: the exact-as-can-be answer (float64 arithmetic), for the allclose checks.
``apply_float32``: the same sum in float32, one rounding per multiply and per add, terms added
in the stencil's point order starting from zero: what a kernel compiled with FMA contraction
off and that fixed order computes, bit for bit (the decomposed kernels too: each sub-stencil
adds its terms onto the output in the same order). With ``factor=True``, the order of a
factored kernel (``StencilSchedule.factor``): per group of points sharing a coefficient
(``stencil.factor_groups``), its field values summed in point order, then one product added.
``leapfrog_float32`` is one wave step in the same discipline.
"""

from __future__ import annotations

import numpy as np

from tessera.stencil.stencil import Stencil, check_inputs, factor_groups


def _interior_view(u: np.ndarray, h: int, offset, shape) -> np.ndarray:
    dz, dy, dx = offset
    nz, ny, nx = shape
    return u[h + dz:h + dz + nz, h + dy:h + dy + ny, h + dx:h + dx + nx]


def _interior(shape_padded, h: int):
    return tuple(slice(h, n - h) for n in shape_padded)


def _terms(stencil: Stencil, u, coeffs, shape, dtype, factor: bool):
    """Each product added in turn: (coefficient, field value or the sum of its group's)."""
    groups = factor_groups(stencil.points) if factor else [(p.coeff, (p,)) for p in stencil.points]
    for coeff, points in groups:
        c = np.asarray(coeffs[coeff], dtype=dtype) if isinstance(coeff, str) else dtype(coeff)
        total = _interior_view(u, stencil.halo, points[0].offset, shape)
        for p in points[1:]:
            total = total + _interior_view(u, stencil.halo, p.offset, shape)
        yield c, total


def _apply(stencil: Stencil, u, coeffs, dtype, factor: bool = False) -> np.ndarray:
    shape = tuple(n - 2 * stencil.halo for n in u.shape)
    check_inputs(stencil, shape, u, coeffs)
    u = np.asarray(u, dtype=dtype)
    acc = np.zeros(shape, dtype=dtype)
    for c, value in _terms(stencil, u, coeffs, shape, dtype, factor):
        acc = acc + (c * value).astype(dtype, copy=False)
    out = np.zeros(u.shape, dtype=dtype)
    out[_interior(u.shape, stencil.halo)] = acc
    return out


def apply_float64(stencil: Stencil, u: np.ndarray, coeffs: dict[str, np.ndarray]) -> np.ndarray:
    return _apply(stencil, u, coeffs, np.float64)


def apply_float32(stencil: Stencil, u: np.ndarray, coeffs: dict[str, np.ndarray], *,
                  factor: bool = False) -> np.ndarray:
    return _apply(stencil, u, coeffs, np.float32, factor)


def magnitude(stencil: Stencil, u: np.ndarray, coeffs: dict[str, np.ndarray]) -> np.ndarray:
    """sum |c_i u_i| per point: the scale of the float32 error bound."""
    shape = tuple(n - 2 * stencil.halo for n in u.shape)
    check_inputs(stencil, shape, u, coeffs)
    au = np.abs(np.asarray(u, dtype=np.float64))
    total = np.zeros(shape)
    for p in stencil.points:
        c = np.abs(np.asarray(coeffs[p.coeff], dtype=np.float64)) if isinstance(p.coeff, str) else abs(float(p.coeff))
        total += c * _interior_view(au, stencil.halo, p.offset, shape)
    out = np.zeros(u.shape)
    out[_interior(u.shape, stencil.halo)] = total
    return out


def error_bound(stencil: Stencil, u, coeffs) -> np.ndarray:
    """|computed - exact| <= gamma(n + 1) sum |c_i u_i|, gamma(j) = j u / (1 - j u), u = 2^-24: a
    recursive float32 sum of n products rounds once per product and once per add; an FMA
    rounds once for both, so the same bound covers contracted and decomposed kernels; a
    factored one adds a value of a group of k through k - 1 adds, one product and the
    groups' adds, fewer roundings than the n + 1 of the bound."""
    j = len(stencil.points) + 1
    unit = 2.0 ** -24
    return j * unit / (1 - j * unit) * magnitude(stencil, u, coeffs)


def leapfrog_float32(stencil: Stencil, prev: np.ndarray, cur: np.ndarray, coeffs, *,
                     factor: bool = False) -> np.ndarray:
    """next = 2 cur - prev + sum_i c_i u_i, in float32, as the wave kernel orders it:
    acc = 2 cur - prev first, then each term added in point order (``factor``: each group's)."""
    h = stencil.halo
    shape = tuple(n - 2 * h for n in cur.shape)
    check_inputs(stencil, shape, cur, coeffs)
    inner = _interior(cur.shape, h)
    acc = np.float32(2.0) * cur[inner] - prev[inner]
    for c, value in _terms(stencil, cur, coeffs, shape, np.float32, factor):
        acc = acc + (c * value).astype(np.float32, copy=False)
    out = np.zeros_like(cur)
    out[inner] = acc
    return out
