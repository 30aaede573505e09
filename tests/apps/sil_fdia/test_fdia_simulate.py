"""The SIL-IoT simulator: seeded, and its lamps obey their physics."""

import numpy as np
import pytest

from tessera.apps.sil_fdia.config import LampConfig, SimConfig
from tessera.apps.sil_fdia.simulate import DARK_W_M2, FIELDS, simulate

CONFIG = SimConfig(num_lamps=3, num_days=3, seed=4)


@pytest.fixture(scope="module")
def dep():
    return simulate(CONFIG)


def test_same_seed_same_deployment_other_seed_other(dep):
    again = simulate(CONFIG)
    for name in FIELDS:
        np.testing.assert_array_equal(dep.telemetry[name], again.telemetry[name])
    np.testing.assert_array_equal(dep.true_kills, again.true_kills)
    other = simulate(SimConfig(num_lamps=3, num_days=3, seed=5))
    assert not np.array_equal(dep.true_kills, other.true_kills)


def test_kills_only_when_on_and_on_only_in_the_dark(dep):
    on = dep.telemetry["on"] > 0
    assert dep.true_kills[~on].sum() == 0 and dep.true_kills.sum() > 100
    np.testing.assert_array_equal(dep.telemetry["kills"], dep.true_kills)  # an honest gateway
    assert np.all(dep.irradiance[on.any(axis=0)] < DARK_W_M2)
    assert np.all(dep.telemetry["panel_a"][:, dep.irradiance < 1.0] < 0.06)  # noise only: 0.01 A sd


def test_kill_times_lie_in_their_interval(dep):
    for lamp in range(CONFIG.num_lamps):
        for k, times in enumerate(dep.kill_times[lamp]):
            assert times.size == dep.true_kills[lamp, k]
            assert np.all((times >= 0) & (times < CONFIG.interval_s))


def test_battery_energy_balance_and_bounds(dep):
    lamp = CONFIG.lamp
    assert np.all((dep.soc >= 0) & (dep.soc <= 1))
    energy = dep.soc * lamp.battery_wh
    flow = dep.telemetry["battery_a"][:, 1:] * (11.8 + dep.soc[:, 1:]) * CONFIG.interval_s / 3600
    # the only gap is the current sensor's noise: 0.02 A x 12.6 V x 1/6 h = 0.042 Wh sd per interval
    error = np.abs(np.diff(energy, axis=1) - flow)
    # |N(0, 0.042)| has mean 0.034 (bound 0.05) and 0.25 is 6 sd: no interval's balance is off
    assert error.mean() < 0.05 and error.max() < 0.25


def test_grid_dips_with_every_kill(dep):
    tel, on = dep.telemetry, dep.telemetry["on"] > 0
    killed = on & (dep.true_kills > 0)
    assert np.all(tel["grid_kv_min"][killed] < 0.75 * CONFIG.lamp.grid_kv)  # a dip takes 30-70%
    # no kill, no dip: only each converter's 2% spread and 0.01 kV of sensor noise stay
    assert np.all(tel["grid_kv_min"][on & (dep.true_kills == 0)] > 0.95 * CONFIG.lamp.grid_kv)
    assert np.all(tel["grid_kv_mean"][~on] == 0)
    # mean voltage falls with kills: the slope per kill is negative, about -depth * recovery / interval
    for lamp in range(CONFIG.num_lamps):  # each converter has its own no-load voltage: fit per lamp
        slope = np.polyfit(dep.true_kills[lamp][on[lamp]], tel["grid_kv_mean"][lamp][on[lamp]], 1)[0]
        assert -0.5 * 3.5 * 0.5 / 600 * 1.5 < slope < -0.5 * 3.5 * 0.5 / 600 * 0.5


def test_bad_configs_name_the_value():
    with pytest.raises(ValueError, match="interval_s must divide a day"):
        SimConfig(interval_s=7)
    with pytest.raises(ValueError, match="num_lamps"):
        SimConfig(num_lamps=0)
    with pytest.raises(ValueError, match="low_voltage_cutoff < reconnect_soc"):
        LampConfig(low_voltage_cutoff=0.5, reconnect_soc=0.2)
