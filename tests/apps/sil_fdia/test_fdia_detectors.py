"""The detectors, end to end on a simulated deployment: each beats chance on the attacks its
evidence can see, alarms hold on held-out clean nights, and fusion is not worse than its
better half (deterministic: everything is seeded).

Seconds, not minutes: the recorder is replaced by counts drawn the way the zap detector
errs at 15 dB on whole 10-min intervals (measured on the benchmark's development seed 0):
dry, each zap heard with probability 0.985 and ~0.02 false zaps an interval; in rain,
0.93 and 12 x (1 - intensity) raindrops passing for zaps, the recorder rejecting
47 - 14 x intensity onsets a second. The audio itself is tested in test_fdia_audio and by
the quick benchmark (tests/bench/test_bench_fdia.py).
"""

import math

import numpy as np
import pytest

from tessera.apps.sil_fdia.detectors import Context
from tessera.apps.sil_fdia.experiment import ExperimentPlan, _sim, run_experiment
from tessera.apps.sil_fdia.sound import Heard, Listening, fit_sound
from tessera.apps.sil_fdia.telemetry_detect import fit_calibration

# seed 0 and calibration seeds 21, 24-26: rain on a test night (day 5, 0.47) and on calibration
# nights both heavier (0.92, 0.62) and about as light (0.51)
PLAN = ExperimentPlan(seed=0, sound_seeds=(21, 24, 25, 26), scenarios_per_kind=2)


def _count(dep, kills: np.ndarray, rng, listen: Listening) -> np.ndarray:
    """What the recorder counts of ``kills`` zaps per (lamp, interval), recording
    ``listen``'s seconds of each 10-min interval (a binomial thinning of the whole interval's)."""
    rain = np.broadcast_to(dep.weather["rain_now"], kills.shape)
    wet = rain > 0
    counts = rng.binomial(kills, np.where(wet, 0.93, 0.985)) + rng.poisson(
        np.where(wet, 12 * (1 - rain) + 0.5, 0.02)
    )
    share = np.where(dep.night_mask(), listen.night_s, listen.day_s) / dep.config.interval_s
    return rng.binomial(counts, np.broadcast_to(share, kills.shape))


BENCH_LISTEN = Listening(night_s=600.0, day_s=20.0)  # the bench's recorder


def recorder(dep, seed: int, days: range, listen: Listening = BENCH_LISTEN) -> Heard:
    rng = np.random.default_rng([seed, 9])
    rain = np.broadcast_to(dep.weather["rain_now"], dep.true_kills.shape)
    counts = _count(dep, dep.true_kills.astype(int), rng, listen)
    per_day = dep.config.intervals_per_day
    listened = np.zeros(counts.shape, dtype=bool)
    listened[:, days.start * per_day : days.stop * per_day] = True
    rejected = np.where(rain > 0, 47 - 14 * rain, 0.02)
    nan = np.where(listened, 0.0, np.nan)
    return Heard(counts + nan, rejected + nan, np.zeros(counts.shape) + nan)


def synthetic_rehear(listen: Listening, seed: int):
    """The recorder listening again where an attacker's loudspeaker plays ``forged`` zaps in
    place of the lamp's own (attacks.forged_zaps): it counts them as it counts real ones."""

    def rehear(dep, heard: Heard, forged: dict) -> Heard:
        out = Heard(heard.counts.copy(), heard.rejected.copy(), heard.level.copy())
        kills = np.zeros(dep.true_kills.shape, dtype=int)
        for (lamp, k), times in forged.items():
            kills[lamp, k] = times.size
        counts = _count(dep, kills, np.random.default_rng([seed, 10]), listen)
        for key in forged:
            if np.isfinite(out.counts[key]):
                out.counts[key] = counts[key]
        return out

    return rehear


def synthetic_context(plan: ExperimentPlan) -> Context:
    dep = _sim(plan, plan.seed, plan.num_lamps, plan.days)
    listen = Listening(night_s=plan.listen_night_s, day_s=plan.listen_day_s)
    pool = []
    for seed in plan.sound_seeds:
        other = _sim(plan, seed, plan.sound_lamps, plan.sound_nights)
        pool.append((other, recorder(other, seed, range(plan.sound_nights), listen)))
    heard = recorder(dep, plan.seed, range(plan.days - plan.test_days, plan.days), listen)
    calib = fit_calibration(dep, dep.telemetry, slice(0, plan.train_days))
    rehear = synthetic_rehear(listen, plan.seed)
    return Context(dep, calib, heard, listen, fit_sound(pool, listen), pool, rehear)


@pytest.fixture(scope="module")
def result():
    return run_experiment(PLAN, progress=False, ctx=synthetic_context(PLAN))


def _auc(result, kind, detector):
    return result["results"][kind]["detectors"][detector]["auc"]


def test_the_plan_tests_rain(result):
    ctx = result["context"]
    assert ctx.heard.rainy().any() and ctx.sound.rain is not None  # rain under test and in calibration


@pytest.mark.parametrize("kind", ["battery", "daytime", "zero", "scale"])
def test_telemetry_physics_sees_what_breaks_physics(result, kind):
    # energy balance (battery), kills while off (daytime), dips without kills (zero), grid sag (scale)
    # 0.75: clearly above chance (0.5); measured 0.91-0.99 on this seeded run
    assert _auc(result, kind, "telemetry") > 0.75


@pytest.mark.parametrize("kind", ["zero", "scale", "stealthy", "replay"])
def test_sound_hears_what_the_counts_hide(result, kind):
    assert _auc(result, kind, "sound") > 0.8  # clearly above chance; measured 0.90-1.0 (seeded)


def test_an_attacker_who_forges_the_sound_blinds_it(result):
    # replay_audio plays the replayed night's zaps at the lamp: heard agrees with reported,
    # so the sound sees no more than chance (0.5; 0.7 leaves a small sample's noise, measured
    # 0.49 on this seeded run), where plain replay's sound AUC is above 0.8 (the test above)
    assert _auc(result, "replay_audio", "sound") < 0.7
    # the telemetry's checks across lamps still see a replay (measured fused 0.72, telemetry 0.72; 0.6 is above chance)
    assert _auc(result, "replay_audio", "fused") > 0.6


def test_neighbour_false_alarms_are_reported(result):
    for res in result["results"].values():
        for det in res["detectors"].values():
            assert 0.0 <= det["neighbour_false_alarm_rate"] <= 1.0


def test_sound_cannot_see_a_battery_spoof(result):
    # the microphone knows nothing of the battery: no better than chance (the test can fail
    # if the sound score leaks time of day or the report itself)
    # chance is 0.5; 0.65 leaves room for a small sample's noise (measured 0.62 on this seeded run)
    assert _auc(result, "battery", "sound") < 0.65


def test_fused_is_not_worse_than_its_better_detector(result):
    for kind, res in result["results"].items():
        aucs = {name: det["auc"] for name, det in res["detectors"].items()}
        assert aucs["fused"] > 0.5, kind  # above chance on every kind (measured >= 0.91)
        # adding a detector that sees nothing costs something, never everything: at most 0.15
        # of AUC (measured: 0.034 under the better one at most, on stealthy)
        assert aucs["fused"] > max(aucs["telemetry"], aucs["sound"]) - 0.15, (kind, aucs)
    delays = result["results"]["battery"]["detectors"]["telemetry"]["delays_min"]
    assert any(math.isfinite(d) for d in delays)


def test_thresholds_hold_on_the_held_out_clean_nights(result):
    # set for 1% of clean night intervals on other nights (telemetry: the calibration days;
    # sound: the calibration deployments); on the test nights with no attack anywhere
    # (4 lamps x 2 nights, whole nights at a time since the score accumulates) 4% is the
    # target plus that clustering's sampling noise (measured 0.4% on this seeded run), and the
    # ~30% of the first version is far
    rates = result["clean_false_alarms"]
    assert max(rates.values()) <= 0.04, rates  # the 4% above


def test_scores_are_finite_and_labels_cover_both_classes(result):
    for res in result["results"].values():
        for run, score in zip(res["runs"], res["scores"], strict=True):
            assert (run["y"] == 1).any() and (run["y"] == 0).any()
            for values in score.values():
                assert np.all(np.isfinite(values))
