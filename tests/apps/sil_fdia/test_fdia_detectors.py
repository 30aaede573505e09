"""The detectors, end to end on a small deployment: each beats chance on the attacks its
evidence can see, on a held-out test day (deterministic: the plan is seeded).

Small plan: 3 lamps, 2 clean days, 1 fusion day, 1 test day, 30 s of audio per night
interval, a busy night (1500 insects) so that 30 s of listening hears a few zaps.
"""

import math

import numpy as np
import pytest

from tessera.apps.sil_fdia.detectors import COUNT_KINDS
from tessera.apps.sil_fdia.experiment import ExperimentPlan, run_experiment

PLAN = ExperimentPlan(
    num_lamps=3, train_days=2, fusion_days=1, test_days=1, listen_night_s=30.0, listen_day_s=2.0,
    scenarios_per_kind=1, targets=1, insects_per_night=1500.0, workers=1, seed=3,
)  # fmt: skip


@pytest.fixture(scope="module")
def result():
    return run_experiment(PLAN, progress=False)


def _auc(result, kind, detector):
    return result["results"][kind]["detectors"][detector]["auc"]


@pytest.mark.parametrize("kind", ["battery", "daytime", "zero", "scale"])
def test_telemetry_physics_sees_what_breaks_physics(result, kind):
    # energy balance (battery), kills while off (daytime), dips without kills (zero), grid sag (scale)
    assert _auc(result, kind, "telemetry") > 0.75


@pytest.mark.parametrize("kind", ["zero", "scale", "stealthy"])
def test_sound_hears_what_the_counts_hide(result, kind):
    assert _auc(result, kind, "sound") > 0.6


def test_sound_cannot_see_a_battery_spoof(result):
    # the microphone knows nothing of the battery: no better than chance (the test can fail
    # if the sound score leaks time of day or the report itself)
    assert _auc(result, "battery", "sound") < 0.65


def _fused_ok(res) -> tuple[bool, dict]:
    aucs = {name: det["auc"] for name, det in res["detectors"].items()}
    return aucs["fused"] > 0.5 and aucs["fused"] > max(aucs["telemetry"], aucs["sound"]) - 0.2, aucs


@pytest.mark.xfail(
    strict=True,
    reason="known defect: the fusion, fitted on one night, underweights sound for the stealthy "
    "attack on this small plan (fused 0.49 vs sound 0.70, telemetry 0.46); docs/fdia.md",
)
def test_fused_is_not_worse_than_its_better_detector_on_stealthy(result):
    ok, aucs = _fused_ok(result["results"]["stealthy"])
    assert ok, aucs


def test_fused_beats_chance_everywhere_and_alarms_on_battery(result):
    for kind, res in result["results"].items():
        if kind == "stealthy":  # the known defect above, tested apart so it stays visible
            continue
        aucs = {name: det["auc"] for name, det in res["detectors"].items()}
        assert aucs["fused"] > 0.5, kind
        # fusing with a detector that sees nothing costs something, never everything
        assert aucs["fused"] > max(aucs["telemetry"], aucs["sound"]) - 0.2, (kind, aucs)
    delays = result["results"]["battery"]["detectors"]["telemetry"]["delays_min"]
    assert any(math.isfinite(d) for d in delays)


def test_scores_are_finite_and_labels_cover_both_classes(result):
    for res in result["results"].values():
        for run, score in zip(res["runs"], res["scores"], strict=True):
            assert (run["y"] == 1).any() and (run["y"] == 0).any()
            for values in score.values():
                assert np.all(np.isfinite(values))


def test_sound_threshold_holds_on_the_held_out_night(result):
    # the sound's threshold is set for 1% false alarms on the pooled clean nights (days 0-2);
    # on the held-out night's clean intervals (3 lamps x ~66 night intervals: a binomial sd of
    # ~0.7 points at 1%) it may drift with that night's weather, but must not ring on half of
    # them as the single-night threshold did: <= 5% is 1% plus ~5 sd of sampling noise
    rates = [result["results"][kind]["detectors"]["sound"]["false_alarm_rate"] for kind in COUNT_KINDS]
    assert np.mean(rates) <= 0.05, rates
