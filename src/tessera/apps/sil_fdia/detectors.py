"""The three detectors compared: telemetry-only (physics residuals + isolation forest),
sound-only (heard vs reported kills) and both fused.

Telemetry-only and sound-only are unsupervised: each input (and the causal running mean of
the slow ones, so evidence that builds over intervals counts) is turned into a tail score
against clean intervals, and the detector's score is the largest. Fusion is a logistic
regression on the two scores, trained on attacked nights kept apart from the nights it is
scored on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from tessera.apps.sil_fdia.attacks import Attack, apply_attack
from tessera.apps.sil_fdia.simulate import Deployment
from tessera.apps.sil_fdia.sound import SOUND_NAMES, Listening, SoundCalibration, ewma, sound_features
from tessera.apps.sil_fdia.telemetry_detect import FEATURE_NAMES, Calibration, telemetry_features

SMOOTHED = ("grid_z", "grid_abs_z", "share_z", "isolation")
DETECTORS = ("telemetry", "sound", "fused")
# the 4 h after an attack ends are neither attacked nor clean: the energy balance over 18
# intervals (3 h) and the running means still remember it there
GUARD_INTERVALS = 24
COUNT_KINDS = ("scale", "additive", "constant", "zero", "stealthy")


@dataclass
class Context:
    """Everything fitted on clean data that the detectors' inputs need."""

    dep: Deployment
    calib: Calibration
    heard: np.ndarray
    listen: Listening
    sound: SoundCalibration
    sound_clean: np.ndarray  # (lamps, intervals): the clean intervals listened to, pooled over nights


def inputs(ctx: Context, tel: dict) -> dict[str, np.ndarray]:
    """Source ("telemetry", "sound") -> (lamps, intervals, features)."""
    t = telemetry_features(ctx.dep, tel, ctx.calib)
    smooth = np.stack([ewma(t[..., FEATURE_NAMES.index(n)]) for n in SMOOTHED], axis=-1)
    telemetry = np.concatenate([t, smooth], axis=-1)
    sound = sound_features(ctx.dep, tel, ctx.heard, ctx.listen, ctx.sound)
    return {"telemetry": telemetry, "sound": sound}


def feature_names(detector: str) -> list[str]:
    telemetry = [*FEATURE_NAMES, *(f"{n}_ewma" for n in SMOOTHED)]
    return {"telemetry": telemetry, "sound": list(SOUND_NAMES)}[detector]


def clean_inputs(ctx: Context, fusion_span: slice) -> dict[str, np.ndarray]:
    """Source -> (N, F): the clean intervals each detector's tail score is fitted on. Telemetry:
    the fusion days (its constants and isolation forest were fitted on the clean days, so there
    it would be in-sample). Sound: every clean interval listened to, clean and fusion days
    pooled, so that the score's scale spans several nights' weather, not one night's."""
    x = inputs(ctx, ctx.dep.telemetry)
    telemetry = x["telemetry"][:, fusion_span]
    return {"telemetry": telemetry.reshape(-1, telemetry.shape[-1]), "sound": x["sound"][ctx.sound_clean]}


def sound_threshold(ctx: Context, models: dict, false_alarm_rate: float) -> float:
    """The sound score exceeded by ``false_alarm_rate`` of the pooled clean intervals the lamp
    reports on (at night: where the count attacks strike and the score can ring)."""
    on = ctx.sound_clean & (ctx.dep.telemetry["on"] > 0)
    return float(
        np.quantile(models["sound"](inputs(ctx, ctx.dep.telemetry)["sound"][on]), 1.0 - false_alarm_rate)
    )


def eligible(kind: str, clean_tel: dict, night: np.ndarray) -> np.ndarray:
    """The intervals an attack of this kind can change: where its AUC is measured."""
    on = clean_tel["on"] > 0
    if kind in COUNT_KINDS:
        return on
    if kind == "daytime":
        return ~on
    # battery and replay attacks strike at night: compare with night intervals, so that a
    # score that merely knows night from day (the sound's recorder listens longer at night)
    # does not pass for a detector
    return np.broadcast_to(night, on.shape)


def labels(attack: Attack, changed: np.ndarray, interval_s: int) -> np.ndarray:
    """1 attacked (changed), 0 clean, -1 left out (inside the window but unchanged, or the guard after it)."""
    y = changed.astype(int)
    stop = int(np.ceil(attack.end_h * 3600 / interval_s))
    start = int(np.floor(attack.start_h * 3600 / interval_s))
    for lamp in attack.lamps:
        ignore = np.zeros(changed.shape[1], dtype=bool)
        ignore[start : stop + GUARD_INTERVALS] = True
        y[lamp] = np.where(ignore & ~changed[lamp], -1, y[lamp])
    return y


def scenario(ctx: Context, attack: Attack, span: slice) -> dict:
    """Inputs and labels of one attack, restricted to the intervals in ``span``."""
    tel, changed = apply_attack(ctx.dep, attack)
    x = {k: v[:, span] for k, v in inputs(ctx, tel).items()}
    y = labels(attack, changed, ctx.dep.config.interval_s)[:, span]
    y = np.where(eligible(attack.kind, ctx.dep.telemetry, ctx.dep.night_mask())[:, span], y, -1)
    return {"attack": attack, "x": x, "y": y, "span": span}


class TailScore:
    """How surprising each input is against its clean distribution, the largest over inputs.

    Per input: -log10 of the share of clean values at least as large (add-one smoothed),
    continued past the largest clean value by how many clean inter-quantile ranges
    (median to 99th percentile) it lies beyond, capped at 3 more decades. Signed inputs are
    taken both ways. No attack is seen in fitting: only clean intervals.
    """

    def __init__(self, signed: list[bool]):
        self.signed = np.asarray(signed)

    def _both_ways(self, x: np.ndarray) -> np.ndarray:
        return np.concatenate([x, -x[:, self.signed]], axis=1)

    def fit(self, clean: np.ndarray) -> TailScore:
        x = self._both_ways(clean)
        self.sorted = np.sort(x, axis=0)
        self.top = self.sorted[-1]
        self.scale = np.maximum(np.quantile(x, 0.99, axis=0) - np.median(x, axis=0), 1e-3)
        return self

    def per_input(self, x: np.ndarray) -> np.ndarray:
        x = self._both_ways(x)
        n = self.sorted.shape[0]
        at_least = np.stack(
            [n - np.searchsorted(self.sorted[:, j], x[:, j], side="left") for j in range(x.shape[1])], axis=1
        )
        beyond = np.clip((x - self.top) / self.scale, 0.0, 3.0)
        return -np.log10((1 + at_least) / (n + 1)) + beyond

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.per_input(x).max(axis=1)


SIGNED = {"grid_z", "share_z", "sound_z", "sound_z_ewma", "grid_z_ewma", "share_z_ewma"}


def fit_detectors(clean: dict[str, np.ndarray], scenarios: list[dict]) -> dict:
    """Telemetry-only and sound-only: tail scores fitted on ``clean`` (source -> (N, F));
    fused: a logistic regression on the two scores, each first re-expressed as its own
    tail score against the same clean intervals (so both speak in -log10 p and a noisy
    wide-ranged score does not drown a quiet one), trained on attacked ``scenarios``."""
    models = {}
    for name in ("telemetry", "sound"):
        signed = [n in SIGNED for n in feature_names(name)]
        models[name] = TailScore(signed).fit(clean[name])
        models[f"{name}_p"] = TailScore([False]).fit(models[name](clean[name])[:, None])
    xs = np.concatenate([_pair(models, sc["x"])[sc["y"] >= 0] for sc in scenarios])
    ys = np.concatenate([sc["y"][sc["y"] >= 0] for sc in scenarios])
    models["fused"] = LogisticRegression(C=1.0, class_weight="balanced", max_iter=1000).fit(xs, ys)
    return models


def _raw(models: dict, x: dict[str, np.ndarray], name: str) -> np.ndarray:
    return models[name](x[name].reshape(-1, x[name].shape[-1])).reshape(x[name].shape[:2])


def _pair(models: dict, x: dict[str, np.ndarray]) -> np.ndarray:
    """(lamps, intervals, 2): each detector's score as a tail score against clean intervals."""
    cols = [models[f"{n}_p"](_raw(models, x, n).reshape(-1, 1)) for n in ("telemetry", "sound")]
    return np.stack(cols, axis=-1).reshape(*x["telemetry"].shape[:2], 2)


def score(models: dict, sc: dict) -> dict[str, np.ndarray]:
    """Detector -> (lamps, intervals) scores, higher meaning more likely attacked."""
    pair = _pair(models, sc["x"])
    fused = models["fused"].decision_function(pair.reshape(-1, 2)).reshape(pair.shape[:2])
    return {
        "telemetry": _raw(models, sc["x"], "telemetry"),
        "sound": _raw(models, sc["x"], "sound"),
        "fused": fused,
    }


def auc(scores: list[np.ndarray], ys: list[np.ndarray]) -> float:
    y = np.concatenate([v[v >= 0] for v in ys])
    s = np.concatenate([sc[v >= 0] for sc, v in zip(scores, ys, strict=True)])
    return float(roc_auc_score(y, s)) if 0 < y.sum() < y.size else float("nan")


def threshold(scores: list[np.ndarray], ys: list[np.ndarray], false_alarm_rate: float) -> float:
    clean = np.concatenate([sc[v == 0] for sc, v in zip(scores, ys, strict=True)])
    return float(np.quantile(clean, 1.0 - false_alarm_rate))


def delays_min(s: dict, scores: np.ndarray, thr: float, interval_s: int) -> list[float]:
    """Per target lamp: minutes from the attack's first changed report to the first alarm on it
    (inf when none rings before the attack ends)."""
    out = []
    for lamp in s["attack"].lamps:
        hit = np.flatnonzero(s["y"][lamp] == 1)
        if hit.size == 0:
            continue
        index = np.arange(s["y"].shape[1])
        alarms = np.flatnonzero((index >= hit[0]) & (index <= hit[-1]) & (scores[lamp] > thr))
        out.append(float((alarms[0] - hit[0] + 1) * interval_s / 60) if alarms.size else float("inf"))
    return out
