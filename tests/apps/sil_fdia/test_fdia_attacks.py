"""Every attack changes only the reports of its target lamps inside its window."""

import numpy as np
import pytest

from tessera.apps.sil_fdia.attacks import KINDS, Attack, apply_attack
from tessera.apps.sil_fdia.config import SimConfig
from tessera.apps.sil_fdia.simulate import simulate

PER_H = 6  # 10-minute intervals


@pytest.fixture(scope="module")
def dep():
    return simulate(SimConfig(num_lamps=3, num_days=3, seed=2))


def _attack(kind):
    # day 2 from 20:30 to 02:30 (48 h = noon of day 2), or its afternoon for daytime kills
    start = 48.5 if kind == "daytime" else 56.5
    return Attack(kind=kind, start_h=start, end_h=start + 6, lamps=(1,), seed=3)


@pytest.mark.parametrize("kind", KINDS)
def test_attack_changes_only_its_window_and_targets(dep, kind):
    before = {k: v.copy() for k, v in dep.telemetry.items()}
    attack = _attack(kind)
    tel, changed = apply_attack(dep, attack)
    window = np.zeros(changed.shape, dtype=bool)
    window[1, int(attack.start_h * PER_H) : int(attack.end_h * PER_H)] = True
    assert changed.any(), kind
    assert not (changed & ~window).any(), kind
    for key in tel:
        np.testing.assert_array_equal(tel[key][[0, 2]], dep.telemetry[key][[0, 2]])
        np.testing.assert_array_equal(dep.telemetry[key], before[key])  # the clean record is untouched


def test_scale_zero_and_daytime_do_what_they_say(dep):
    clean = dep.telemetry
    tel, changed = apply_attack(dep, _attack("scale"))
    np.testing.assert_array_equal(tel["kills"][changed], np.rint(1.5 * clean["kills"][changed]))
    tel, changed = apply_attack(dep, _attack("zero"))
    assert tel["kills"][changed].sum() == 0 and clean["kills"][changed].min() > 0
    tel, changed = apply_attack(dep, _attack("daytime"))
    assert np.all(tel["on"][changed] == 0) and tel["kills"][changed].min() > 0


def test_stealthy_keeps_the_counts_statistics(dep):
    tel, changed = apply_attack(dep, _attack("stealthy"))
    forged, real = tel["kills"][1][changed[1]], dep.telemetry["kills"][1][changed[1]]
    # the forged counts follow the lamp's per-slot means over the days before (not tonight's weather)
    slots = np.flatnonzero(changed[1]) % 144
    history = dep.telemetry["kills"][1, : 2 * 144].reshape(2, 144)[:, slots].mean(axis=0)
    # Poisson draws around those means: their average is within 4 standard errors
    assert abs(forged.mean() - history.mean()) < 4 * np.sqrt(history.mean() / forged.size)
    assert not np.array_equal(forged, real)
    # the grid's mean voltage is forged to agree with the forged counts
    on = dep.telemetry["on"][1, : 2 * 144] > 0  # what the attacker saw before the attack
    slope = np.polyfit(
        dep.telemetry["kills"][1, : 2 * 144][on], dep.telemetry["grid_kv_mean"][1, : 2 * 144][on], 1
    )[0]
    shift = tel["grid_kv_mean"][1][changed[1]] - dep.telemetry["grid_kv_mean"][1][changed[1]]
    # atol 1e-9: float64 (x + d) - x rounds d by ~1e-15 at these kV values; 1e-9 is still far
    # below any forged shift that used another slope
    np.testing.assert_allclose(shift, slope * (forged - real), atol=1e-9)


def test_bad_attacks_are_one_line_errors(dep):
    with pytest.raises(ValueError, match="unknown attack 'flood'"):
        Attack(kind="flood", start_h=1, end_h=2, lamps=(0,))
    with pytest.raises(ValueError, match="outside the simulated period 0 h to 72 h"):
        apply_attack(dep, Attack(kind="scale", start_h=70, end_h=80, lamps=(0,)))
    with pytest.raises(ValueError, match="unknown lamp id 7"):
        apply_attack(dep, Attack(kind="scale", start_h=50, end_h=52, lamps=(7,)))
    with pytest.raises(ValueError, match="replay of 3 day"):
        apply_attack(dep, Attack(kind="replay", start_h=50, end_h=52, lamps=(0,), magnitude=3))
    with pytest.raises(ValueError, match="must end after it starts"):
        Attack(kind="zero", start_h=5, end_h=5, lamps=(0,))
    with pytest.raises(ValueError) as info:
        apply_attack(dep, Attack(kind="battery", start_h=-1, end_h=2, lamps=(0,)))
    assert "\n" not in str(info.value)
