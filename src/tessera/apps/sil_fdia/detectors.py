"""The three detectors compared: telemetry-only (physics residuals + isolation forest),
sound-only (heard vs reported kills) and both fused.

Every detector is fitted on clean data only (no attack is seen before the test) and turns
each interval's evidence into a log-likelihood ratio increment of "attacked" against
"clean", accumulated per lamp by a CUSUM (S = max(0, S + increment)) that restarts at
noon, so a lamp's score at an interval is the evidence of the night so far: the alarm
statistic an operator would watch. Streams and their alternatives:

- telemetry "tail": the telemetry's surprise (the largest tail score of its residuals,
  re-expressed as a p-value against clean intervals), against a p-value ~ Beta(0.1, 1);
- telemetry "grid": the grid relation's z, each way, against a mean shift of one
  standard deviation (a count forged up or down);
- sound "up", "down": the heard-minus-reported z each way, the same;
- sound "spread": the same z against a doubled standard deviation (forged counts that
  keep the mean, like the stealthy attack's and replay's, scatter instead).

A detector's score is its largest stream, a log-likelihood ratio in nats; fused is the sum
of the two detectors' scores (independent evidence: log-likelihood ratios add). Calibrating
each to -ln p against its clean scores before adding was tried on the development seed: the
sound's clean scores are almost all 0, so any small positive one read as rare, and the
fused alarm rang on 4% of held-out clean intervals. Alarm thresholds are the 1 - rate
quantile of the clean night intervals' scores: telemetry on the calibration days of the
deployment, sound on the pooled nights of the calibration deployments, fused on every
pairing of the two (their clean evidence is independent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from sklearn.metrics import roc_auc_score

from tessera.apps.sil_fdia.attacks import Attack, apply_attack, forged_zaps
from tessera.apps.sil_fdia.simulate import Deployment
from tessera.apps.sil_fdia.sound import Heard, Listening, SoundCalibration, sound_z
from tessera.apps.sil_fdia.telemetry_detect import (
    FEATURE_NAMES,
    Calibration,
    telemetry_features,
)

DETECTORS = ("telemetry", "sound", "fused")
# the 4 h after an attack ends are neither attacked nor clean: the energy balance over 18
# intervals (3 h) and the night's CUSUM still remember it there
GUARD_INTERVALS = 24
COUNT_KINDS = ("scale", "additive", "constant", "zero", "stealthy")
SIGNED = {"grid_z", "share_z"}
TAIL_LAMBDA = 0.1  # p ~ Beta(0.1, 1) when attacked: increment ln 0.1 + 0.9 ln(1/p), -1.4 a clean interval
SHIFT_SD = 1.0  # mean-shift streams: increment d z - d^2 / 2 for a shift of d standard deviations
SPREAD_RATIO = 2.0  # spread stream: sd x 2 when attacked
Z_CLIP = 5.0  # one interval's z counts at most this far (heavier tails than a Gaussian's)
STREAMS = {"telemetry": 3, "sound": 3, "fused": 9}  # fused: every pair of the two's streams


@dataclass
class Context:
    """The deployment under test and everything fitted on clean data that its scores need."""

    dep: Deployment
    calib: Calibration  # telemetry constants, fitted on the deployment's first clean days
    heard: Heard  # the deployment's test days, listened to
    listen: Listening
    sound: SoundCalibration  # fitted on the calibration deployments' clean nights
    pool: list[tuple[Deployment, Heard]] = field(default_factory=list)  # those deployments
    # (dep, heard, forged) -> heard with the forged intervals listened to again (an attack
    # that forges the sound: attacks.forged_zaps); None: no attack may forge it
    rehear: Callable[[Deployment, Heard, dict], Heard] | None = None


def inputs(ctx: Context, tel: dict, heard: Heard | None = None) -> dict[str, np.ndarray]:
    """ "telemetry": (lamps, intervals, features); "sound": (lamps, intervals) z, from
    ``heard`` (default: what the recorder heard with no attack on the sound)."""
    return {
        "telemetry": telemetry_features(ctx.dep, tel, ctx.calib),
        "sound": sound_z(ctx.dep, tel, ctx.heard if heard is None else heard, ctx.listen, ctx.sound),
    }


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


def cusum(increments: np.ndarray, per_day: int) -> np.ndarray:
    """(lamps, intervals) S = max(0, S + increment) along intervals, restarting every
    ``per_day`` intervals (at noon: the arrays start at noon of a day)."""
    out = np.empty_like(increments)
    acc = np.zeros(increments.shape[0])
    for k in range(increments.shape[1]):
        if k % per_day == 0:
            acc[:] = 0.0
        acc = np.maximum(0.0, acc + increments[:, k])
        out[:, k] = acc
    return out


def _shift(z: np.ndarray) -> list[np.ndarray]:
    """Increments for a shift up and down; 0 where z is NaN (nothing observed: no evidence
    either way, so the night's sum holds through a rain spell rather than decaying)."""
    z = np.clip(z, -Z_CLIP, Z_CLIP)
    return [np.nan_to_num(SHIFT_SD * z - SHIFT_SD**2 / 2), np.nan_to_num(-SHIFT_SD * z - SHIFT_SD**2 / 2)]


def _spread(z: np.ndarray) -> np.ndarray:
    r2 = SPREAD_RATIO**2
    return np.nan_to_num(0.5 * np.clip(z, -Z_CLIP, Z_CLIP) ** 2 * (1 - 1 / r2) - np.log(SPREAD_RATIO))


@dataclass
class Detectors:
    """Fitted on clean intervals only."""

    tail: TailScore  # over the telemetry's residuals
    tail_p: TailScore  # the telemetry's largest tail score -> -log10 p
    grid_sd: float  # grid_z's spread on clean night intervals
    per_day: int
    thresholds: dict[str, float] = field(default_factory=dict)

    def increments(self, x: dict[str, np.ndarray]) -> dict[str, list[np.ndarray]]:
        tel = x["telemetry"]
        raw = self.tail(tel.reshape(-1, tel.shape[-1]))[:, None]
        s = self.tail_p(raw).reshape(tel.shape[:2])
        streams = [np.log(TAIL_LAMBDA) + (1 - TAIL_LAMBDA) * np.log(10.0) * s]
        streams += _shift(tel[..., FEATURE_NAMES.index("grid_z")] / self.grid_sd)
        z = x["sound"]  # already in the count model's standard deviations, per weather class
        return {"telemetry": streams, "sound": [*_shift(z), _spread(z)]}

    def score(self, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Detector -> (lamps, intervals) the night's evidence so far, higher = more likely attacked."""
        out = {
            name: np.max([cusum(inc, self.per_day) for inc in streams], axis=0)
            for name, streams in self.increments(x).items()
        }
        out["fused"] = out["telemetry"] + out["sound"]
        return out


def _night_sd(values: np.ndarray, on: np.ndarray) -> float:
    return float(max(np.std(values[on]), 1e-6))


def fit_detectors(ctx: Context, calib_span: slice, false_alarm_rate: float) -> Detectors:
    """Fit on the deployment's clean ``calib_span`` (telemetry) and the pooled clean nights
    of the calibration deployments (sound); set each detector's alarm threshold."""
    per_day = ctx.dep.config.intervals_per_day
    tel = inputs(ctx, ctx.dep.telemetry)["telemetry"][:, calib_span]
    on = ctx.dep.telemetry["on"][:, calib_span] > 0
    flat = tel.reshape(-1, tel.shape[-1])
    tail = TailScore([n in SIGNED for n in FEATURE_NAMES]).fit(flat)
    tail_p = TailScore([False]).fit(tail(flat)[:, None])
    grid_sd = _night_sd(tel[..., FEATURE_NAMES.index("grid_z")], on)
    pool_z = [sound_z(dep, dep.telemetry, heard, ctx.listen, ctx.sound) for dep, heard in ctx.pool]
    pool_on = [dep.telemetry["on"] > 0 for dep, _ in ctx.pool]
    models = Detectors(tail, tail_p, grid_sd, per_day)
    tel_score = models.score({"telemetry": tel, "sound": np.full(tel.shape[:2], np.nan)})["telemetry"]
    sound_scores = [
        models.score({"telemetry": np.zeros((*z.shape, tel.shape[-1])), "sound": z})["sound"] for z in pool_z
    ]
    q = 1.0 - false_alarm_rate
    # never below ln(streams / rate): a CUSUM of true log-likelihood ratios passes h about
    # once in e^h clean intervals per stream; on few calibration nights whose clean scores
    # are nearly all 0 the empirical quantile alone can sit at one interval's evidence
    floor = {n: np.log(k / false_alarm_rate) for n, k in STREAMS.items()}
    pooled = np.concatenate([s[m] for s, m in zip(sound_scores, pool_on, strict=True)])
    models.thresholds["telemetry"] = max(float(np.quantile(tel_score[on], q)), floor["telemetry"])
    models.thresholds["sound"] = max(float(np.quantile(pooled, q)), floor["sound"])
    paired = _paired_threshold(tel_score, on, sound_scores, per_day, q)
    models.thresholds["fused"] = max(paired, floor["fused"])
    return models


def _lamp_days(score: np.ndarray, per_day: int) -> np.ndarray:
    lamps, n = score.shape
    return score.reshape(lamps * (n // per_day), per_day)


def _paired_threshold(
    tel: np.ndarray, on: np.ndarray, sound: list[np.ndarray], per_day: int, q: float
) -> float:
    """The fused score's clean quantile over every (telemetry lamp-day, sound lamp-day) pair:
    the clean telemetry and the clean sound come from different deployments, and clean
    evidence from the two is independent, so every pairing is a clean night of both."""
    tel_days, on_days = _lamp_days(tel, per_day), _lamp_days(on, per_day)
    sound_days = np.concatenate([_lamp_days(s, per_day) for s in sound])
    fused = tel_days[:, None, :] + sound_days[None, :, :]
    mask = np.broadcast_to(on_days[:, None, :], fused.shape)
    return float(np.quantile(fused[mask], q))


def eligible(kind: str, clean_tel: dict, night: np.ndarray) -> np.ndarray:
    """The intervals an attack of this kind can change: where its AUC is measured."""
    on = clean_tel["on"] > 0
    if kind in COUNT_KINDS:
        return on
    if kind == "daytime":
        return ~on
    # battery and replay attacks (replay_audio too) strike at night: compare with night intervals, so that a
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
    """Inputs over the whole period (the CUSUM runs through it) and labels, -1 outside ``span``."""
    tel, changed = apply_attack(ctx.dep, attack)
    y = labels(attack, changed, ctx.dep.config.interval_s)
    y = np.where(eligible(attack.kind, ctx.dep.telemetry, ctx.dep.night_mask()), y, -1)
    inside = np.zeros(y.shape[1], dtype=bool)
    inside[span] = True
    forged = forged_zaps(ctx.dep, attack)
    if forged and ctx.rehear is None:
        raise ValueError(f"the {attack.kind} attack forges the sound: this context cannot listen again")
    heard = ctx.rehear(ctx.dep, ctx.heard, forged) if forged else None
    return {"attack": attack, "x": inputs(ctx, tel, heard), "y": np.where(inside, y, -1), "span": span,
            "neighbours": neighbours(attack, y, ctx.dep.config.interval_s)}  # fmt: skip


def neighbours(attack: Attack, y: np.ndarray, interval_s: int) -> np.ndarray:
    """(lamps, intervals) the clean intervals (y == 0) of the lamps the attack leaves alone,
    from its start to the end of the guard after it: where a check across lamps (the field
    share) can blame a neighbour for the attacked lamps' forged counts."""
    start = int(np.floor(attack.start_h * 3600 / interval_s))
    stop = int(np.ceil(attack.end_h * 3600 / interval_s)) + GUARD_INTERVALS
    mask = np.zeros(y.shape, dtype=bool)
    mask[:, start:stop] = True
    mask[list(attack.lamps)] = False
    return mask & (y == 0)


def auc(scores: list[np.ndarray], ys: list[np.ndarray]) -> float:
    y = np.concatenate([v[v >= 0] for v in ys])
    s = np.concatenate([sc[v >= 0] for sc, v in zip(scores, ys, strict=True)])
    return float(roc_auc_score(y, s)) if 0 < y.sum() < y.size else float("nan")


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
