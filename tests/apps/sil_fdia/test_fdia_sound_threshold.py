"""The sound detector's alarm threshold carries over to nights it has not seen.

No audio here (seconds, not minutes): heard counts are drawn the way the zap detector errs,
each zap missed with a probability that rises in rain and a few false zaps, on a simulated
deployment whose nightly insect rates vary with the weather. The threshold is set for 1%
false alarms on pooled clean nights; it must ring on few clean intervals of later nights.
"""

import numpy as np

from tessera.apps.sil_fdia.config import SimConfig
from tessera.apps.sil_fdia.detectors import (
    SIGNED,
    Context,
    TailScore,
    clean_inputs,
    feature_names,
    inputs,
    sound_threshold,
)
from tessera.apps.sil_fdia.simulate import simulate
from tessera.apps.sil_fdia.sound import Listening, fit_sound
from tessera.apps.sil_fdia.telemetry_detect import fit_calibration

CLEAN_DAYS, DAYS = 5, 10


def _false_alarm_rate(fit_days: range, seed: int = 2) -> tuple[float, float]:
    """(share of held-out clean on-intervals above the 1% threshold, rainy share of the held-out nights)."""
    dep = simulate(SimConfig(num_lamps=4, num_days=DAYS, seed=seed))
    rng = np.random.default_rng(seed)
    recall = 0.98 - 0.15 * dep.weather["rain_now"]  # rain masks zaps for its whole spell
    heard = rng.binomial(dep.true_kills.astype(int), recall[None, :]) + rng.poisson(0.1, dep.true_kills.shape)
    per_day = dep.config.intervals_per_day
    clean = np.zeros(heard.shape, dtype=bool)
    clean[:, fit_days.start * per_day : fit_days.stop * per_day] = True
    listen = Listening(night_s=float(dep.config.interval_s), day_s=float(dep.config.interval_s))
    calib = fit_calibration(dep, dep.telemetry, slice(0, CLEAN_DAYS))
    ctx = Context(
        dep, calib, heard.astype(float), listen, fit_sound(dep, dep.telemetry, heard, listen, clean), clean
    )
    span = slice(fit_days.start * per_day, fit_days.stop * per_day)
    signed = [n in SIGNED for n in feature_names("sound")]
    models = {"sound": TailScore(signed).fit(clean_inputs(ctx, span)["sound"])}
    threshold = sound_threshold(ctx, models, 0.01)
    test = np.zeros(heard.shape, dtype=bool)
    test[:, CLEAN_DAYS * per_day :] = True
    test &= dep.telemetry["on"] > 0
    scores = models["sound"](inputs(ctx, dep.telemetry)["sound"][test])
    rainy = float(np.mean(dep.weather["rain"][CLEAN_DAYS:] > 0))
    return float(np.mean(scores > threshold)), rainy


def test_pooled_threshold_holds_on_held_out_nights():
    rate, rainy = _false_alarm_rate(range(0, CLEAN_DAYS))
    assert rainy > 0  # the held-out nights must include weather that hides zaps, or this tests nothing
    # target 1%; the held-out set is 4 lamps x 5 nights x ~66 intervals (~1300: a binomial sd
    # of ~0.3 points), and 5 calibration nights cannot span every night's weather, so the rate
    # may drift above 1% but should stay well under the ~50% that one night's threshold gave
    assert rate <= 0.05, rate

