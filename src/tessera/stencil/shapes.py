"""The shipped stencil shapes, as offset -> weight tables of a discrete Laplacian (grid step 1).

``star(r)``: the axis-only stencil of radius ``r`` (1..6), 6r + 1 points: the centre and
(+-m, 0, 0), (0, +-m, 0), (0, 0, +-m) for m = 1..r, weighted by the central finite-difference
second derivative of order 2r (Fornberg's weights, closed form
``w_m = 2 (-1)^(m+1) (r!)^2 / (m^2 (r-m)! (r+m)!)``, ``w_0 = -2 sum w_m`` per axis).
star-7 is r = 1, star-25 is r = 4.

``ete37``: star(4) (25 points) plus the 12 planar diagonals at distance one,
(+-1, +-1, 0), (+-1, 0, +-1), (0, +-1, +-1): 37 points, halo 4.
``ete73``: star(6) (37 points) plus the planar diagonals at distances 1..3,
(+-m, +-m, 0), (+-m, 0, +-m), (0, +-m, +-m) for m = 1, 2, 3 (36 points): 73 points, halo 6.

Where they come from: the ETE papers (../shared/seeds/, Explicit Time Evolution and
stencil decomposition) name 37- and 73-point 3-D stencils made of a high-order axis star
and off-axis points, but their abstracts do not list the point sets. These two are Tessera's
own construction of that family (the time-space-domain finite-difference stencils the ETE
method belongs to add exactly such coordinate-plane diagonals to a high-order star), with
the counts the papers name. Their weights are a consistent Laplacian, not the ETE
method's CFL-dependent optimised coefficients: 3/4 of the star's Laplacian plus 1/4 of the
diagonal Laplacian, whose second differences along (1, 1, 0)/sqrt2 and (1, -1, 0)/sqrt2 in
each coordinate plane (step sqrt2, the same Fornberg weights over 2 h^2) sum to 2 x the
Laplacian over the three planes. Both parts are exact on quadratics, so the mix is too.
"""

from __future__ import annotations

from fractions import Fraction
from math import factorial

import numpy as np

from tessera.stencil.names import SHAPES  # where the command line reads them without numpy

Offset = tuple[int, int, int]
MAX_STAR_RADIUS = 6
DIAGONAL_SHARE = Fraction(1, 4)


def second_derivative_weights(order_radius: int) -> list[Fraction]:
    """w_0..w_r of the central second difference of order 2r (exact fractions)."""
    r = order_radius
    w = [Fraction(2 * (-1) ** (m + 1) * factorial(r) ** 2, m * m * factorial(r - m) * factorial(r + m))
         for m in range(1, r + 1)]
    return [-2 * sum(w)] + w


def _add(table: dict[Offset, Fraction], offset: Offset, weight: Fraction) -> None:
    table[offset] = table.get(offset, Fraction(0)) + weight


def star_weights(radius: int) -> dict[Offset, Fraction]:
    if not isinstance(radius, int) or not 1 <= radius <= MAX_STAR_RADIUS:
        raise ValueError(f"star radius {radius!r}; shipped radii are 1..{MAX_STAR_RADIUS}")
    w = second_derivative_weights(radius)
    table: dict[Offset, Fraction] = {(0, 0, 0): 3 * w[0]}
    for axis in range(3):
        for m in range(1, radius + 1):
            for sign in (1, -1):
                off = [0, 0, 0]
                off[axis] = sign * m
                _add(table, tuple(off), w[m])
    return table


def diagonal_weights(radius: int) -> dict[Offset, Fraction]:
    """Half the sum, over the three coordinate planes, of the second differences along both
    diagonals (step sqrt2): a Laplacian on the points (+-m, +-m, 0) and permutations."""
    w = second_derivative_weights(radius)
    table: dict[Offset, Fraction] = {(0, 0, 0): Fraction(0)}
    for a, b in ((0, 1), (0, 2), (1, 2)):
        for sb in (1, -1):  # the two diagonals of the plane
            _add(table, (0, 0, 0), w[0] / 4)  # 1/2 (sum) x 1/2 (1 / (sqrt2)^2)
            for m in range(1, radius + 1):
                for sign in (1, -1):
                    off = [0, 0, 0]
                    off[a], off[b] = sign * m, sign * sb * m
                    _add(table, tuple(off), w[m] / 4)
    return table


def _mix(star: dict[Offset, Fraction], diag: dict[Offset, Fraction]) -> dict[Offset, Fraction]:
    table: dict[Offset, Fraction] = {}
    for off, wt in star.items():
        _add(table, off, (1 - DIAGONAL_SHARE) * wt)
    for off, wt in diag.items():
        _add(table, off, DIAGONAL_SHARE * wt)
    return table


def shape_weights(name: str) -> dict[Offset, Fraction]:
    """Offset -> weight for a shipped shape, in ascending (dz, dy, dx) order: the order of the
    offsets' addresses in the field, in which the generated kernels load each field value
    once for all the rows they compute together (``codegen``: a row's terms must be added in
    the stencil's order, and that order is then also the order of the loads)."""
    if name.startswith("star") and name[4:].isdigit() and (int(name[4:]) - 1) % 6 == 0:
        table = star_weights((int(name[4:]) - 1) // 6)
    elif name == "ete37":
        table = _mix(star_weights(4), diagonal_weights(1))
    elif name == "ete73":
        table = _mix(star_weights(6), diagonal_weights(3))
    else:
        raise ValueError(f"unknown stencil shape {name!r}; shipped: {', '.join(SHAPES)}")
    return {o: table[o] for o in sorted(table)}


def symmetry_class(offset: Offset) -> tuple[int, ...]:
    """Offsets that map onto each other by sign flips and axis permutations share a class."""
    return tuple(sorted(abs(c) for c in offset))


def symbol_max(weights: dict[Offset, float], samples: int = 33) -> float:
    """max over wavenumbers k in [0, pi]^3 of -sum_p w_p cos(k . p): the largest eigenvalue of
    minus the stencil on an unbounded grid (the stencils are symmetric, so the symbol is real).
    The grid includes k = pi on every axis, where star and diagonal stencils peak."""
    k = np.linspace(0.0, np.pi, samples)
    kz, ky, kx = np.meshgrid(k, k, k, indexing="ij")
    total = np.zeros_like(kz)
    for (dz, dy, dx), wt in weights.items():
        total -= float(wt) * np.cos(kz * dz + ky * dy + kx * dx)
    return float(total.max())

