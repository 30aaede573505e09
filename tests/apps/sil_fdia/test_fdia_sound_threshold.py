"""The sound detector's alarm threshold carries over to nights it has not seen.

No audio here (seconds, not minutes): heard counts are drawn the way the zap detector errs,
each zap missed with a probability that rises in rain, false zaps from raindrops, and the
recorder's rain indicator (rejected onsets a second), on simulated deployments whose
nightly insect rates vary with the weather. The count model and the threshold (1% of clean
night intervals) come from calibration deployments of other seeds; the test deployment's
clean nights, rainy ones among them, must ring on few intervals.
"""

import dataclasses

import numpy as np
import pytest

from tessera.apps.sil_fdia.config import SimConfig
from tessera.apps.sil_fdia.detectors import Context, fit_detectors, inputs
from tessera.apps.sil_fdia.simulate import simulate
from tessera.apps.sil_fdia.sound import Heard, Listening, fit_sound
from tessera.apps.sil_fdia.telemetry_detect import fit_calibration

TRAIN, CALIB, DAYS = 3, 2, 9
POOL_SEEDS = (21, 22, 23, 24, 25, 26)


def _heard(dep, seed: int) -> Heard:
    rng = np.random.default_rng([seed, 5])
    rain = dep.weather["rain_now"]
    recall = 0.98 - 0.25 * rain  # rain masks zaps for its whole spell
    counts = rng.binomial(dep.true_kills.astype(int), recall[None, :]) + rng.poisson(
        0.1 + 2.0 * rain, dep.true_kills.shape
    )
    # the recorder hears the rain: raindrops are rejected onsets, fewer as heavier rain raises the floor
    rejected = np.where(rain > 0, 47.0 - 14.0 * rain, 0.05) + np.zeros(dep.true_kills.shape)
    # the zap band's floor: up with the rain's intensity, give or take the wind's 1 dB
    level = 1.0 + 8.0 * rain + rng.normal(0.0, 1.0, dep.true_kills.shape)
    return Heard(counts.astype(float), rejected, level)


def _deployments():
    listen = Listening(night_s=600.0, day_s=600.0)
    pool = []
    for seed in POOL_SEEDS:
        dep = simulate(SimConfig(num_lamps=1, num_days=2, seed=seed))
        pool.append((dep, _heard(dep, seed)))
    dep = simulate(SimConfig(num_lamps=4, num_days=DAYS, seed=2))
    return dep, _heard(dep, 2), pool, listen


@pytest.fixture(scope="module")
def deployments():
    return _deployments()


def _fit(deployments, deaf: bool):
    dep, heard, pool, listen = deployments
    if deaf:  # the contrast: a recorder deaf to the rain counts through it with one model
        pool = [(d, dataclasses.replace(h, rejected=np.zeros_like(h.rejected))) for d, h in pool]
        heard = dataclasses.replace(heard, rejected=np.zeros_like(heard.rejected))
    ctx = Context(
        dep,
        fit_calibration(dep, dep.telemetry, slice(0, TRAIN)),
        heard,
        listen,
        fit_sound(pool, listen),
        pool,
    )
    per_day = dep.config.intervals_per_day
    models = fit_detectors(ctx, slice(TRAIN * per_day, (TRAIN + CALIB) * per_day), 0.01)
    return ctx, models


def test_pooled_threshold_holds_on_held_out_nights(deployments):
    dep = deployments[0]
    assert (dep.weather["rain"][TRAIN + CALIB :] > 0).any()  # held-out rain, or this tests nothing
    assert sum((d.weather["rain"] > 0).any() for d, _ in deployments[2]) >= 1  # and calibration rain
    ctx, models = _fit(deployments, deaf=False)
    scores = models.score(inputs(ctx, dep.telemetry))["sound"]
    test = (dep.telemetry["on"] > 0) & (
        np.arange(dep.config.num_intervals) >= (TRAIN + CALIB) * dep.config.intervals_per_day
    )
    rate = float(np.mean(scores[test] > models.thresholds["sound"]))
    # target 1%; the held-out set is 4 lamps x 4 nights x ~63 intervals (~1000, whole nights
    # at a time since the score accumulates over a night): 3% is the target plus that
    # clustering's sampling noise
    assert rate <= 0.03, rate


def test_rain_has_its_own_count_model_and_a_deaf_recorder_pays(deployments):
    ctx, models = _fit(deployments, deaf=False)
    night_rain = ctx.heard.rainy() & (ctx.dep.telemetry["on"] > 0)
    z = inputs(ctx, ctx.dep.telemetry)["sound"][night_rain]
    covered = ctx.sound.rain.covers(ctx.heard.rejected[night_rain])
    # it speaks for the rain its calibration nights heard (here one held-out night's heavy
    # rain), without a bias; lighter rain than any of theirs is left out, not guessed at
    assert covered.any() and not covered.all() and np.array_equal(np.isfinite(z), covered)
    assert abs(np.mean(z[covered])) < 0.5  # z-scores: a bias under half a standard deviation
    # counted through the rain with one model, the rainy intervals' misses and raindrop
    # zaps set the clean scores' tail: the threshold (the evidence an attack must bring)
    # rises several fold
    _, deaf = _fit(deployments, deaf=True)
    assert deaf.thresholds["sound"] > 3 * models.thresholds["sound"], (deaf.thresholds, models.thresholds)
