"""The shipped shapes hold exactly the documented offsets, and their weights are a
consistent Laplacian (zero on constants, exact on quadratics)."""

import itertools

import pytest

from tessera.stencil.shapes import SHAPES, shape_weights, symbol_max


def _star(r):
    pts = {(0, 0, 0)}
    for axis, m, sign in itertools.product(range(3), range(1, r + 1), (1, -1)):
        off = [0, 0, 0]
        off[axis] = sign * m
        pts.add(tuple(off))
    return pts


def _planar_diagonals(radius):
    pts = set()
    for (a, b), m, sa, sb in itertools.product(((0, 1), (0, 2), (1, 2)), range(1, radius + 1), (1, -1), (1, -1)):
        off = [0, 0, 0]
        off[a], off[b] = sa * m, sb * m
        pts.add(tuple(off))
    return pts


@pytest.mark.parametrize("radius", range(1, 7))
def test_star_offsets(radius):
    w = shape_weights(f"star{6 * radius + 1}")
    assert set(w) == _star(radius) and len(w) == 6 * radius + 1


@pytest.mark.parametrize("name", SHAPES)
def test_offsets_come_in_address_order(name):
    """Ascending (dz, dy, dx): the order the kernels load field values in (see codegen)."""
    offsets = list(shape_weights(name))
    assert offsets == sorted(offsets)


def test_ete_offsets():
    assert set(shape_weights("ete37")) == _star(4) | _planar_diagonals(1)
    assert set(shape_weights("ete73")) == _star(6) | _planar_diagonals(3)
    assert len(shape_weights("ete37")) == 37 and len(shape_weights("ete73")) == 73


@pytest.mark.parametrize("name", SHAPES)
def test_weights_are_a_laplacian(name):
    w = shape_weights(name)
    assert sum(w.values()) == 0  # exact fractions: a constant field has zero Laplacian
    for q in ((2, 0, 0), (0, 2, 0), (0, 0, 2), (1, 1, 0), (0, 1, 1)):  # exact on x^2 (->2), x y (->0)
        value = sum(wt * o[0] ** q[0] * o[1] ** q[1] * o[2] ** q[2] for o, wt in w.items())
        assert value == (2 if 2 in q else 0)
    assert symbol_max(w) > 0


def test_unknown_shape():
    with pytest.raises(ValueError, match="unknown stencil shape 'star8'"):
        shape_weights("star8")
