"""A stencil as data: a list of offsets, each with a coefficient that is a scalar or the name
of a 3-D coefficient array (spatially variant; several offsets may share one array), over
3-D float32 grids with a halo.

Layout: a field over an (nz, ny, nx) interior is stored with its halo, shape
(nz + 2h, ny + 2h, nx + 2h), C order (x is the unit-stride axis); a coefficient array has
the interior's shape. Applying the stencil writes, for every interior point p,

    out[p] = sum_i c_i(p) * u[p + offset_i]        (in the order of ``points``)

and leaves out's halo alone. Every offset must lie within the halo (|component| <= h), so
no read leaves the array and the kernels need no bounds guards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.stencil import shapes

Offset = tuple[int, int, int]
COEFFICIENT_KINDS = ("constant", "point", "class")


@dataclass(frozen=True)
class Point:
    offset: Offset
    coeff: float | str  # a scalar, or the name of a coefficient array


@dataclass(frozen=True, kw_only=True)
class Stencil:
    name: str
    points: tuple[Point, ...]
    halo: int

    def __post_init__(self):
        if not self.points:
            raise ValueError(f"stencil {self.name!r} has no points")
        if not isinstance(self.halo, int) or self.halo < 0:
            raise ValueError(f"stencil {self.name!r}: halo {self.halo!r} must be an int >= 0")
        seen = set()
        for p in self.points:
            if len(p.offset) != 3 or not all(isinstance(c, int) for c in p.offset):
                raise ValueError(f"stencil {self.name!r}: offset {p.offset!r} must be three ints (dz, dy, dx)")
            reach = max(abs(c) for c in p.offset)
            if reach > self.halo:
                raise ValueError(
                    f"stencil {self.name!r}: offset {p.offset} reaches {reach} cells but the halo is "
                    f"{self.halo}; use halo >= {reach}")
            if p.offset in seen:
                raise ValueError(f"stencil {self.name!r}: offset {p.offset} appears twice")
            seen.add(p.offset)
            if isinstance(p.coeff, str) and not p.coeff.isidentifier():
                raise ValueError(f"stencil {self.name!r}: coefficient array name {p.coeff!r} is not an identifier")
            if not isinstance(p.coeff, str | int | float):
                raise ValueError(f"stencil {self.name!r}: coefficient {p.coeff!r} must be a number or an array name")

    @property
    def arrays(self) -> tuple[str, ...]:
        """Coefficient array names, in order of first use."""
        return tuple(dict.fromkeys(p.coeff for p in self.points if isinstance(p.coeff, str)))

    @property
    def variable(self) -> bool:
        return bool(self.arrays)

    @property
    def radius(self) -> int:
        return max(max(abs(c) for c in p.offset) for p in self.points)

    def signature(self) -> str:
        pts = ";".join(f"{p.offset}:{p.coeff if isinstance(p.coeff, str) else float(p.coeff).hex()}"
                       for p in self.points)
        return f"{self.name}|h{self.halo}|{pts}"


def factor_groups(points) -> list[tuple[float | str, tuple[Point, ...]]]:
    """``points`` grouped by coefficient (an equal scalar or the same array), the groups in
    order of their first point, each group's points in point order: a factored sweep sums
    each group's field values and multiplies the sum once (``StencilSchedule.factor``)."""
    groups: dict[float | str, list[Point]] = {}
    for p in points:
        groups.setdefault(p.coeff, []).append(p)
    return [(c, tuple(g)) for c, g in groups.items()]


def padded_shape(shape: tuple[int, int, int], halo: int) -> tuple[int, int, int]:
    return tuple(n + 2 * halo for n in shape)


def check_grid(shape) -> tuple[int, int, int]:
    if len(shape) != 3 or not all(isinstance(n, int | np.integer) and n >= 1 for n in shape):
        raise ValueError(f"grid shape {tuple(shape)!r} must be three ints >= 1 (nz, ny, nx)")
    return tuple(int(n) for n in shape)


def check_inputs(stencil: Stencil, shape: tuple[int, int, int], u, coeffs: dict) -> None:
    """One-line errors for a field or coefficient array of the wrong shape, a missing or
    unknown coefficient array."""
    want = padded_shape(shape, stencil.halo)
    if tuple(u.shape) != want:
        raise ValueError(
            f"{stencil.name}: field has shape {tuple(u.shape)}; a {shape} grid with halo {stencil.halo} "
            f"needs {want}")
    names = stencil.arrays
    missing = [n for n in names if n not in coeffs]
    if missing:
        raise ValueError(f"{stencil.name}: coefficient arrays {missing} missing (the stencil uses {list(names)})")
    extra = sorted(set(coeffs) - set(names))
    if extra:
        raise ValueError(f"{stencil.name}: unknown coefficient arrays {extra} (the stencil uses {list(names)})")
    for n in names:
        if tuple(coeffs[n].shape) != shape:
            raise ValueError(
                f"{stencil.name}: coefficient array {n!r} has shape {tuple(coeffs[n].shape)}; "
                f"it must have the grid's interior shape {shape}")


def make_stencil(shape: str, coefficients: str = "constant") -> Stencil:
    """A shipped shape (``shapes.SHAPES``) with its Laplacian weights as scalars
    (``constant``), one coefficient array per offset (``point``), or one per symmetry class
    of offsets (``class``: offsets equal up to sign flips and axis permutations share one)."""
    if coefficients not in COEFFICIENT_KINDS:
        raise ValueError(f"coefficients {coefficients!r}; choose one of {', '.join(COEFFICIENT_KINDS)}")
    weights = shapes.shape_weights(shape)
    points = []
    for i, (off, wt) in enumerate(weights.items()):
        if coefficients == "constant":
            coeff: float | str = float(np.float32(float(wt)))
        elif coefficients == "point":
            coeff = f"c{i}"
        else:
            coeff = "k" + "_".join(str(c) for c in shapes.symmetry_class(off))
        points.append(Point(off, coeff))
    halo = max(max(abs(c) for c in off) for off in weights)
    return Stencil(name=f"{shape}-{coefficients}", points=tuple(points), halo=halo)


def weight_arrays(stencil: Stencil, shape_name: str, grid: tuple[int, int, int], *, scale=None,
                  rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """Coefficient arrays for a stencil of ``make_stencil(shape_name, ...)``: each offset's
    weight times ``scale`` (a grid-shaped array, e.g. (v dt / h)^2), or, with ``rng``, times
    a random factor in [0.5, 1.5) per point (a spatially variant test case)."""
    weights = shapes.shape_weights(shape_name)
    by_name: dict[str, float] = {}
    for p in stencil.points:
        if isinstance(p.coeff, str):
            by_name.setdefault(p.coeff, float(weights[p.offset]))
    out = {}
    for name, wt in by_name.items():
        factor = rng.uniform(0.5, 1.5, size=grid) if rng is not None else (1.0 if scale is None else scale)
        out[name] = np.ascontiguousarray(np.broadcast_to(wt * factor, grid), dtype=np.float32)
    return out
