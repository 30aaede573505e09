"""The attacker who forges the sound (``replay_audio``): the microphone at the target lamp
hears the replayed night's zaps, not tonight's, and nothing else changes."""

import numpy as np
import pytest

from tessera.apps.sil_fdia.attacks import Attack, apply_attack, forged_zaps
from tessera.apps.sil_fdia.config import AudioConfig, SimConfig
from tessera.apps.sil_fdia.simulate import simulate
from tessera.apps.sil_fdia.sound import Heard, Listening, hear_forged, interval_audio
from tessera.apps.sil_fdia.zaps import detect_zaps, f1_score

PER_DAY = 144
ATTACK = Attack(kind="replay_audio", start_h=56.5, end_h=62.5, lamps=(1,), seed=3)  # day 2, 20:30-02:30
AUDIO = AudioConfig(snr_db=15.0, seed=2)


@pytest.fixture(scope="module")
def dep():
    return simulate(SimConfig(num_lamps=3, num_days=3, seed=2))


def _window():
    return range(int(ATTACK.start_h * 6), int(ATTACK.end_h * 6))


def _dry(dep):
    # the window's intervals without rain (a rain spell covers its first 2 h here): light
    # rain passes for zaps at 15 dB, which the count model knows but a direct count does not
    return [k for k in _window() if dep.weather["rain_now"][k] == 0]


def test_forged_zaps_are_the_recorded_night_at_the_target_only(dep):
    forged = forged_zaps(dep, ATTACK)
    assert set(forged) == {(1, k) for k in _window()}
    for (lamp, k), times in forged.items():
        np.testing.assert_array_equal(times, dep.kill_times[lamp][k - PER_DAY])
    # its telemetry is replay's, field for field
    tel, changed = apply_attack(dep, ATTACK)
    ref, ref_changed = apply_attack(dep, Attack(kind="replay", start_h=56.5, end_h=62.5, lamps=(1,), seed=3))
    np.testing.assert_array_equal(changed, ref_changed)
    for key in tel:
        np.testing.assert_array_equal(tel[key], ref[key])
    assert forged_zaps(dep, Attack(kind="replay", start_h=56.5, end_h=62.5, lamps=(1,))) == {}


def test_the_microphone_hears_the_replayed_zaps_not_tonights(dep):
    forged = forged_zaps(dep, ATTACK)
    # the interval of the window whose replayed and real zaps differ most in number
    k = max(_dry(dep), key=lambda i: abs(forged[(1, i)].size - dep.kill_times[1][i].size) + 1e-3 * i)
    replayed, tonight = forged[(1, k)], dep.kill_times[1][k]
    clip, truth = interval_audio(dep, 1, k, AUDIO, 600.0, zap_times=replayed)
    np.testing.assert_array_equal(truth, replayed[replayed < 600.0 - 0.03])
    found = detect_zaps(clip)
    # at 15 dB the counter is nearly exact (F1 0.98 in the bench's sweep): the replayed zaps
    # are found; tonight's, which the grid never fired, are not (a chance pairing within
    # 10 ms of 600 s is rare: F1 near 0)
    assert f1_score(found, replayed)["f1"] > 0.85
    assert f1_score(found, tonight)["f1"] < 0.2
    assert abs(found.size - replayed.size) <= 2 < abs(replayed.size - tonight.size)


def test_hear_forged_changes_only_the_forged_intervals(dep):
    forged = forged_zaps(dep, ATTACK)
    ks = np.array([int(ATTACK.start_h * 6) - 1, *_dry(dep)[:3]])  # one before the window
    shape = dep.true_kills.shape
    nan = np.full(shape, np.nan)
    heard = Heard(nan.copy(), nan.copy(), nan.copy())
    heard.counts[:, ks], heard.rejected[:, ks], heard.level[:, ks] = 0.0, 0.0, 0.0
    listen = Listening(night_s=60.0, day_s=10.0)
    out = hear_forged(dep, heard, forged, AUDIO, listen)
    changed = ~np.isclose(np.nan_to_num(out.counts, nan=-1), np.nan_to_num(heard.counts, nan=-1))
    changed |= ~np.isclose(np.nan_to_num(out.level, nan=-1), np.nan_to_num(heard.level, nan=-1))
    expect = np.zeros(shape, dtype=bool)
    expect[1, ks[1:]] = True  # the target's forged intervals that were listened to; no others
    np.testing.assert_array_equal(changed, expect)
    for k in ks[1:]:
        # the first 60 s of each: the replayed zaps in them, counted within 1 (15 dB)
        within = np.sum(forged[(1, k)] < 60.0 - 0.03)
        assert abs(out.counts[1, k] - within) <= 1
