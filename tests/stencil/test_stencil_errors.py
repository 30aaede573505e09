"""Bad input: a one-line ValueError that names the numbers."""

import numpy as np
import pytest

from tessera.stencil import (
    Point,
    Stencil,
    StencilSchedule,
    compile_stencil,
    compile_wave,
    make_stencil,
    padded_shape,
    weight_arrays,
)


def _one_line(exc):
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_offset_beyond_halo():
    with pytest.raises(ValueError) as exc:
        Stencil(name="s", points=(Point((0, 0, 0), 1.0), Point((0, 5, 0), "c")), halo=4)
    assert "offset (0, 5, 0) reaches 5 cells but the halo is 4" in _one_line(exc)


def test_wrong_coefficient_shape():
    st = make_stencil("star7", "point")
    grid = (4, 5, 6)
    u = np.zeros(padded_shape(grid, 1), np.float32)
    co = weight_arrays(st, "star7", grid)
    co["c3"] = np.zeros((4, 5, 7), np.float32)
    with pytest.raises(ValueError) as exc:
        compile_stencil(st, grid)(u, co)
    assert "coefficient array 'c3' has shape (4, 5, 7); it must have the grid's interior shape (4, 5, 6)" in _one_line(exc)


def test_wrong_field_shape_and_missing_arrays():
    st = make_stencil("star7", "point")
    grid = (4, 5, 6)
    kernel = compile_stencil(st, grid)
    with pytest.raises(ValueError) as exc:
        kernel(np.zeros((4, 5, 6), np.float32), weight_arrays(st, "star7", grid))
    assert "field has shape (4, 5, 6); a (4, 5, 6) grid with halo 1 needs (6, 7, 8)" in _one_line(exc)
    with pytest.raises(ValueError, match=r"coefficient arrays \['c0'\] missing"):
        co = weight_arrays(st, "star7", grid)
        del co["c0"]
        kernel(np.zeros((6, 7, 8), np.float32), co)


def test_bad_schedules():
    with pytest.raises(ValueError, match="split_level 'plane'"):
        StencilSchedule(split_level="plane")
    with pytest.raises(ValueError, match="ty=0 must be an int >= 1"):
        StencilSchedule(ty=0)
    with pytest.raises(ValueError, match="time_block=2 applies to the wave kernel only"):
        compile_stencil(make_stencil("star7"), (3, 3, 3), StencilSchedule(time_block=2))
    with pytest.raises(ValueError, match="prefetch=-1 must be an int >= 0"):
        StencilSchedule(prefetch=-1)
    with pytest.raises(ValueError, match="prefetch=16 applies to vector kernels"):
        StencilSchedule(prefetch=16, vectorize=False)
    with pytest.raises(ValueError, match="stream=-8 must be an int >= 0"):
        StencilSchedule(stream=-8)
    with pytest.raises(ValueError, match="stream=64 applies to vector kernels"):
        StencilSchedule(stream=64, vectorize=False)
    with pytest.raises(ValueError, match="rz=0 must be an int >= 1"):
        StencilSchedule(rz=0)
    with pytest.raises(ValueError, match="factor=True with split=2: factoring applies to undecomposed sweeps"):
        StencilSchedule(factor=True, split=2)
    with pytest.raises(ValueError, match="factor=1 must be True or False"):
        StencilSchedule(factor=1)
    with pytest.raises(ValueError, match="rz=2, ry=1: the wave kernel computes one row at a time"):
        compile_wave(make_stencil("star7"), (3, 3, 3), StencilSchedule(rz=2))
    with pytest.raises(ValueError, match="nt=True applies to single-pass vector sweeps"):
        StencilSchedule(nt=True, split=2)
    with pytest.raises(ValueError, match="nt=True: the wave kernel reads the buffer it writes"):
        compile_wave(make_stencil("star7"), (3, 3, 3), StencilSchedule(nt=True))


def test_a_wave_grid_narrower_than_the_stencil(capsys):
    """`tessera stencil wave --grid 5` with the radius-4 ete37 used to run and print a field
    made of nothing but the zero boundary; now it is refused before anything is compiled."""
    from tessera.cli import main
    from tessera.stencil.wave import WaveConfig

    with pytest.raises(ValueError) as exc:
        WaveConfig(shape="ete37", grid=(5, 5, 5))
    assert "grid (5, 5, 5) is narrower than ete37's width of 9 cells" in _one_line(exc)
    WaveConfig(shape="ete37", grid=(9, 9, 9))  # the stencil's width is enough
    assert main(["stencil", "wave", "--shape", "ete37", "--grid", "5"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "narrower than ete37's width of 9 cells" in err[0]
