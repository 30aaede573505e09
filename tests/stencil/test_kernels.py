"""Every generated kernel against the numpy references: within the float32 error bound of
the float64 answer (built with FMA contraction, as used), and bit for bit equal to the
float32 reference when built with -ffp-contract=off (one fixed summation order)."""

import re

import numpy as np
import pytest

from tessera.stencil import StencilSchedule, compile_stencil, make_stencil, padded_shape, weight_arrays
from tessera.stencil import reference as ref
from tessera.stencil.codegen import generate_apply

GRID = (5, 7, 19)  # odd on purpose: no tile or vector length divides it
SCHEDULES = [
    StencilSchedule(),
    StencilSchedule(tz=2, ty=3, tx=5, isa="avx2"),
    StencilSchedule(tz=4, ty=2, vectorize=False),
    StencilSchedule(split=3, split_level="grid", ty=4),
    StencilSchedule(split=4, split_level="tile", tz=2, ty=2),
    StencilSchedule(split=2, split_level="row", tx=7),
    StencilSchedule(ry=2, ty=5, tz=2),  # 5 rows: two jammed pairs and one row alone
    StencilSchedule(ry=4, ty=8, split=2, split_level="tile"),
    StencilSchedule(rz=2, ry=2, tz=3, ty=5),  # 3 planes x 5 rows: a 2x2 block, its leftovers 2x1, 1x2, 1x1
    StencilSchedule(rz=4, tz=4, ty=2, tx=7, split=2, split_level="row", isa="avx2"),  # x blocks of 7: tails only
    StencilSchedule(rz=2, tz=3, ty=2, vectorize=False),  # z blocks in the build without vectors
    StencilSchedule(rz=2, ry=2, tz=3, ty=5, prefetch=32),  # prefetches change no value
    StencilSchedule(ry=4, ty=8, tx=9, prefetch=8, isa="avx2"),
    StencilSchedule(rz=2, ry=2, tz=3, ty=5, stream=16, isa="avx2"),  # nor do streaming prefetches
    StencilSchedule(ty=3, nt=True),  # non-temporal stores after a masked head to the output's boundary
    StencilSchedule(rz=2, ry=2, tz=3, ty=5, tx=9, stream=16, nt=True, isa="avx2"),  # x blocks, jammed rows
]
# factored: each group of points sharing a coefficient summed, then multiplied once
FACTORED = [
    StencilSchedule(factor=True),
    StencilSchedule(rz=2, ry=2, tz=3, ty=5, factor=True),  # jammed: its leftover blocks too
    StencilSchedule(tz=2, ty=3, tx=5, prefetch=8, factor=True, isa="avx2"),
    StencilSchedule(tz=2, ty=3, stream=256, factor=True, isa="avx2"),  # prefetching past the field's end
    StencilSchedule(tz=4, ty=2, vectorize=False, factor=True),
    StencilSchedule(rz=4, tz=5, ty=3, stream=64, factor=True, isa="avx2"),  # 4 planes share loads, then 1
    StencilSchedule(rz=2, tz=2, ty=3, stream=64, factor=True, nt=True, isa="avx2"),
]
CASES = [("star7", "constant"), ("star25", "point"), ("ete37", "class"), ("ete73", "point")]


def _inputs(shape_name, kind, seed=0):
    st = make_stencil(shape_name, kind)
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(padded_shape(GRID, st.halo), dtype=np.float32)
    return st, u, weight_arrays(st, shape_name, GRID, rng=rng)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_within_float32_bound_of_float64(case):
    st, u, co = _inputs(*case)
    exact, bound = ref.apply_float64(st, u, co), ref.error_bound(st, u, co)
    for s in SCHEDULES[::2]:  # the other half is built without contraction below
        out = compile_stencil(st, GRID, s)(u, co, threads=2)
        # gamma(n + 1) sum |c_i u_i|: the bound of any order of n float32 products and adds
        assert (np.abs(out - exact) <= bound).all(), s.short()
        assert not out[: st.halo].any() and not out[:, :, -st.halo:].any()  # the halo is left alone


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_bit_identical_to_float32_reference_without_contraction(case):
    st, u, co = _inputs(*case, seed=1)
    want = ref.apply_float32(st, u, co)
    for s in SCHEDULES:
        kernel = compile_stencil(st, GRID, s, contract=False)
        for threads in (1, 2):
            assert np.array_equal(kernel(u, co, threads=threads), want), (s.short(), threads)


# the kinds with shared coefficients (scalars, symmetry-class arrays); a "point" stencil
# has none, so factoring leaves its order as it is
@pytest.mark.parametrize("case", [("star7", "constant"), ("ete37", "class"), ("ete73", "constant")],
                         ids=lambda c: "-".join(c))
def test_factored_kernels_match_their_own_order(case):
    """Bit for bit the float32 reference of the factored order without contraction, and
    within the float32 bound of float64 with it."""
    st, u, co = _inputs(*case, seed=4)
    want = ref.apply_float32(st, u, co, factor=True)
    exact, bound = ref.apply_float64(st, u, co), ref.error_bound(st, u, co)
    for s in FACTORED:
        assert np.array_equal(compile_stencil(st, GRID, s, contract=False)(u, co, threads=2), want), s.short()
        out = compile_stencil(st, GRID, s)(u, co, threads=2)
        assert (np.abs(out - exact) <= bound).all(), s.short()


def test_jammed_factored_rows_load_each_value_once():
    """A factored block of jammed rows loads each field value once in its vector body (the
    values the rows share, such as z neighbours of two planes, are not loaded per row): as
    many loads as the model counts distinct values for that blocking."""
    from tessera.stencil.model import _field_loads

    st = make_stencil("ete73", "constant")
    source = generate_apply(st, GRID, StencilSchedule(rz=2, tz=2, factor=True, isa="avx2"))
    body = source.split("for (; x + 8 <= x1; x += 8) {")[1].split("if (x < x1)")[0]  # the 2-plane block's
    loads = re.findall(r"\bLD\(q \+ (-?\d+)\)", body)
    assert len(loads) == len(set(loads)) == _field_loads(st, GRID, 1, 2) * 2 < 2 * len(st.points)


def test_every_field_alignment_gives_the_same_bits():
    """A constant stencil's rows start with one vector, then go on from the field's next
    vector boundary (points in between computed twice): on a grid whose row pitch is a
    multiple of the vector (24 + 2 x 4 floats), a field placed at each float offset in turn
    puts that start at every distance from the boundary, and each gives the reference's bits
    and leaves the halo alone."""
    grid = (3, 4, 24)  # a pitch of 32 floats: a multiple of the AVX2 vector
    st = make_stencil("star25", "constant")
    rng = np.random.default_rng(6)
    u = rng.standard_normal(padded_shape(grid, st.halo), dtype=np.float32)
    want = ref.apply_float32(st, u, {}, factor=True)
    schedule = StencilSchedule(ty=2, factor=True, isa="avx2")
    assert "tk_h" in generate_apply(st, grid, schedule)  # the aligning start is generated here
    assert "tk_h" not in generate_apply(st, (3, 4, 23), schedule)  # and not at a pitch of 31
    kernel = compile_stencil(st, grid, schedule, contract=False)
    for shift in range(8):
        buf = np.zeros(u.size + 8, np.float32)
        field = buf[shift : shift + u.size].reshape(u.shape)
        field[...] = u
        out_buf = np.zeros(u.size + 8, np.float32)
        out = out_buf[shift : shift + u.size].reshape(u.shape)
        assert np.array_equal(kernel(field, {}, out=out, threads=2), want), shift
        assert not out_buf[:shift].any() and not out_buf[shift + u.size :].any()


@pytest.mark.parametrize("shape_name,kind", [("star7", "point"), ("ete37", "constant")])
def test_non_temporal_stores_at_every_output_alignment_give_the_same_bits(shape_name, kind):
    """Under ``nt`` each row's points up to its output's vector boundary are one masked vector,
    the rest stored past the caches: an output placed at each float offset in turn puts that
    boundary at every distance from the row's start (and 2 rows jammed over a pitch that no
    vector divides keep one row off it), and each gives the reference's bits and leaves the halo and the
    buffer around the output alone."""
    grid = (3, 4, 24 - 2 * (shape_name == "ete37"))  # row pitches 26 and 30 floats
    st = make_stencil(shape_name, kind)
    rng = np.random.default_rng(8)
    u = rng.standard_normal(padded_shape(grid, st.halo), dtype=np.float32)
    co = weight_arrays(st, shape_name, grid, rng=rng)
    want = ref.apply_float32(st, u, co)
    for schedule in (StencilSchedule(ty=2, nt=True, isa="avx2"), StencilSchedule(ry=2, ty=4, nt=True, isa="avx2")):
        source = generate_apply(st, grid, schedule)
        assert "STNT(" in source and "_mm_sfence()" in source
        kernel = compile_stencil(st, grid, schedule, contract=False)
        for shift in range(8):
            out_buf = np.zeros(u.size + 8, np.float32)
            out = out_buf[shift : shift + u.size].reshape(u.shape)
            assert np.array_equal(kernel(u, co, out=out, threads=2), want), (schedule.short(), shift)
            assert not out_buf[:shift].any() and not out_buf[shift + u.size :].any()
            h = st.halo
            assert not out[:h].any() and not out[:, :h].any() and not out[:, :, :h].any()


def test_factored_order_is_its_own():
    """The factored reference is another rounding order (so the test above can fail), and an
    unfactored kernel does not match it."""
    st, u, co = _inputs("ete73", "constant", seed=5)
    factored = ref.apply_float32(st, u, co, factor=True)
    assert not np.array_equal(factored, ref.apply_float32(st, u, co))
    assert not np.array_equal(compile_stencil(st, GRID, contract=False)(u, co), factored)


def test_avx512_schedule_when_available():
    from tessera.kernels.machine import cpu_isas

    if "avx512" not in cpu_isas():
        pytest.skip("no AVX-512 on this CPU")
    st, u, co = _inputs("ete73", "point", seed=2)
    for s in (StencilSchedule(isa="avx512", split=3, split_level="tile", ty=4),
              StencilSchedule(isa="avx512", rz=2, ry=2, tz=4, ty=4)):
        assert np.array_equal(compile_stencil(st, GRID, s, contract=False)(u, co), ref.apply_float32(st, u, co))


def test_reference_differs_when_the_order_does():
    """The bit-exact check can fail: summing the same terms in reverse order changes bits."""
    st, u, co = _inputs("ete73", "point", seed=3)
    reversed_st = type(st)(name="rev", points=st.points[::-1], halo=st.halo)
    assert not np.array_equal(ref.apply_float32(st, u, co), ref.apply_float32(reversed_st, u, co))
    assert np.array_equal(compile_stencil(reversed_st, GRID, contract=False)(u, co), ref.apply_float32(reversed_st, u, co))


def test_each_field_value_is_loaded_once_per_jammed_block():
    """ete73 over 4 planes x 2 rows: 584 terms read 336 distinct field values (the z and y
    lines and the yz diagonals the rows share), and the vector body loads each once."""
    import re

    from tessera.stencil.codegen import generate_apply
    from tessera.stencil.shapes import shape_weights

    st = make_stencil("ete73", "constant")
    want = {(dz + r, dy + j, dx) for dz, dy, dx in shape_weights("ete73") for r in range(4) for j in range(2)}
    source = generate_apply(st, (8, 8, 64), StencilSchedule(rz=4, ry=2, tz=4, ty=2, isa="avx512"))
    block = source.split("x += 16) {", 1)[1].split("ST(o + x", 1)[0]  # the first vector body: the 4 x 2 block
    loads = re.findall(r"= LD\(q \+ (-?\d+)\)", block)
    assert len(loads) == len(set(loads)) == len(want) == 336
    assert len(re.findall(r" \* um?\d+;", block)) == 73 * 8  # every term, each on a loaded value
