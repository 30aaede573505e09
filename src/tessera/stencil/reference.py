"""References for the generated kernels, in numpy slicing (independent of the C generator).

``apply_float64``: the exact-as-can-be answer (float64 arithmetic), for the allclose checks.
``apply_float32``: the same sum in float32, one rounding per multiply and per add, terms added
in the stencil's point order starting from zero: what a kernel compiled with FMA contraction
off and that fixed order computes, bit for bit (the decomposed kernels too: each sub-stencil
adds its terms onto the output in the same order). ``leapfrog_float32`` is one wave step in
the same discipline.
"""

from __future__ import annotations

import numpy as np

from tessera.stencil.stencil import Stencil, check_inputs


def _interior_view(u: np.ndarray, h: int, offset, shape) -> np.ndarray:
    dz, dy, dx = offset
    nz, ny, nx = shape
    return u[h + dz:h + dz + nz, h + dy:h + dy + ny, h + dx:h + dx + nx]


def _interior(shape_padded, h: int):
    return tuple(slice(h, n - h) for n in shape_padded)


def _apply(stencil: Stencil, u, coeffs, dtype) -> np.ndarray:
    shape = tuple(n - 2 * stencil.halo for n in u.shape)
    check_inputs(stencil, shape, u, coeffs)
    u = np.asarray(u, dtype=dtype)
    acc = np.zeros(shape, dtype=dtype)
    for p in stencil.points:
        c = np.asarray(coeffs[p.coeff], dtype=dtype) if isinstance(p.coeff, str) else dtype(p.coeff)
        term = c * _interior_view(u, stencil.halo, p.offset, shape)
        acc = acc + term.astype(dtype, copy=False)
    out = np.zeros(u.shape, dtype=dtype)
    out[_interior(u.shape, stencil.halo)] = acc
    return out


def apply_float64(stencil: Stencil, u: np.ndarray, coeffs: dict[str, np.ndarray]) -> np.ndarray:
    return _apply(stencil, u, coeffs, np.float64)


def apply_float32(stencil: Stencil, u: np.ndarray, coeffs: dict[str, np.ndarray]) -> np.ndarray:
    return _apply(stencil, u, coeffs, np.float32)


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
    rounds once for both, so the same bound covers contracted and decomposed kernels."""
    j = len(stencil.points) + 1
    unit = 2.0 ** -24
    return j * unit / (1 - j * unit) * magnitude(stencil, u, coeffs)


def leapfrog_float32(stencil: Stencil, prev: np.ndarray, cur: np.ndarray, coeffs) -> np.ndarray:
    """next = 2 cur - prev + sum_i c_i u_i, in float32, as the wave kernel orders it:
    acc = 2 cur - prev first, then each term added in point order."""
    h = stencil.halo
    shape = tuple(n - 2 * h for n in cur.shape)
    check_inputs(stencil, shape, cur, coeffs)
    inner = _interior(cur.shape, h)
    acc = np.float32(2.0) * cur[inner] - prev[inner]
    for p in stencil.points:
        c = coeffs[p.coeff] if isinstance(p.coeff, str) else np.float32(p.coeff)
        acc = acc + (c * _interior_view(cur, h, p.offset, shape)).astype(np.float32, copy=False)
    out = np.zeros_like(cur)
    out[inner] = acc
    return out
