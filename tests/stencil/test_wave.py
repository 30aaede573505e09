"""The wave kernel against physics and against the float32 reference."""

import numpy as np
import pytest

from tessera.stencil import StencilSchedule, compile_wave, make_stencil, padded_shape, weight_arrays
from tessera.stencil import reference as ref
from tessera.stencil.wave import WaveConfig, cfl_limit, run_wave


def test_cfl_limits():
    # the classical 3-D leapfrog bound; approx's default 1e-6 relative: float rounding only
    assert cfl_limit("star7") == pytest.approx(1 / 3 ** 0.5)
    for shape in ("star25", "ete37", "ete73"):
        # a sanity range below star7's 1/sqrt(3) = 0.577 (measured 0.45-0.52)
        assert 0.3 < cfl_limit(shape) < 0.6


@pytest.mark.parametrize("time_block,factor", [(1, False), (3, False), (3, True)])
def test_wave_kernel_bit_identical_to_float32_leapfrog(time_block, factor):
    grid, steps, at = (11, 9, 13), 7, (5, 2, 6)
    st = make_stencil("ete37", "class")
    rng = np.random.default_rng(0)
    co = weight_arrays(st, "ete37", grid, scale=rng.uniform(0.02, 0.1, size=grid))
    prev = np.zeros(padded_shape(grid, st.halo), np.float32)
    cur = np.zeros_like(prev)
    prev[4:-4, 4:-4, 4:-4] = rng.standard_normal(grid)
    cur[4:-4, 4:-4, 4:-4] = rng.standard_normal(grid)
    src = rng.standard_normal(steps).astype(np.float32)
    want_prev, want_cur = prev.copy(), cur.copy()
    for t in range(steps):
        nxt = ref.leapfrog_float32(st, want_prev, want_cur, co, factor=factor)
        nxt[tuple(a + st.halo for a in at)] += src[t]
        want_prev, want_cur = want_cur, nxt
    kernel = compile_wave(st, grid, StencilSchedule(time_block=time_block, factor=factor), contract=False)
    got_prev, got_cur = kernel.run(prev, cur, co, src, at, threads=2)
    assert np.array_equal(got_cur, want_cur) and np.array_equal(got_prev, want_prev)


@pytest.mark.parametrize("shape", ["star7", "ete37"])
def test_first_arrival_at_r_over_v(shape):
    """Constant medium: u = s(t - r/v) / (4 pi v^2 r), so the trace at distance r peaks r / v
    after the source's Ricker peak; within one cell's travel time h / v (the source and the
    receiver are each known only to a cell)."""
    v, h, r = 1.0, 1.0, 12
    cfg = WaveConfig(shape=shape, grid=(44, 44, 44), spacing=h, velocity="constant", v_min=v, v_max=v,
                     frequency=v / (15 * h), cfl=0.4, steps=110, source=(22, 22, 16), threads=2)
    result = run_wave(cfg, receivers=((22, 22, 16 + r), (22, 22 + r, 16)))
    peak_src = 1.5 / cfg.peak_frequency
    for trace in result.traces.T:
        t_peak = (np.argmax(trace) + 1) * cfg.dt  # trace[n] is u after step n + 1
        assert abs(t_peak - peak_src - r / v) <= h / v, (t_peak - peak_src, r / v)


def _growth(cfl):
    cfg = WaveConfig(shape="ete37", grid=(20, 20, 20), spacing=1.0, velocity="constant", v_min=1.0, v_max=1.0,
                     frequency=0.1, cfl=cfl, steps=200, source=(10, 10, 10), allow_unstable=True, threads=2)
    return float(np.abs(run_wave(cfg).field).max())


def test_stable_at_the_limit_unstable_beyond():
    limit = cfl_limit("ete37")
    assert _growth(0.99 * limit) < 1.0  # the source adds ~dt^2 per step; bounded at the limit
    assert not _growth(1.05 * limit) < 1e6  # the k = pi mode grows |g| ~ 1.7x a step past it (or overflows)


def test_cfl_past_stability_is_refused():
    with pytest.raises(ValueError) as exc:
        WaveConfig(shape="star7", cfl=0.6)
    assert "CFL number 0.6 exceeds the leapfrog stability limit 0.5774 of star7" in str(exc.value)
    assert "\n" not in str(exc.value)


def test_layered_run_and_snapshots(tmp_path):
    from tessera.stencil.wave import write_snapshots

    cfg = WaveConfig(shape="star13", grid=(24, 16, 24), velocity="layered", steps=30, time_block=2)
    result = run_wave(cfg, snapshots=2)
    paths = write_snapshots(result, tmp_path)
    assert [p.name for p in paths] == ["wave_00015.png", "wave_00030.png"] and all(p.stat().st_size > 1000 for p in paths)
    assert np.isfinite(result.field).all() and np.abs(result.field).max() > 0
