"""What the microphone beside each lamp hears: the audio of each interval (or of its first
``listen_s`` seconds at night and ``day_listen_s`` by day: a duty-cycled recorder, so that
benchmarks need not synthesise whole nights), the zaps the detector counts in it, and the
disagreement between heard and reported kills.

The recorder keeps its own clock: night and day are by sunset and sunrise, not by the
lamp's (attackable) on/off report. Audio depends only on what really happened, so one
deployment's heard counts serve every attack applied to its telemetry.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from tessera.apps.sil_fdia.audio import Weather, synthesize
from tessera.apps.sil_fdia.config import AudioConfig
from tessera.apps.sil_fdia.simulate import Deployment
from tessera.apps.sil_fdia.zaps import listen as hear_clip

SOUND_NAMES = ("sound_z", "sound_abs_z", "sound_z_ewma", "sound_abs_z_ewma")


@dataclass(frozen=True, kw_only=True)
class Listening:
    night_s: float
    day_s: float


def listening(dep: Deployment, audio: AudioConfig, day_listen_s: float | None = None) -> Listening:
    full = float(dep.config.interval_s)
    night = min(full, audio.listen_s or full)
    return Listening(night_s=night, day_s=min(full, day_listen_s or night))


def interval_weather(dep: Deployment, lamp: int, interval: int) -> Weather:
    day = interval // dep.config.intervals_per_day
    activity = min(1.0, dep.true_kills[lamp, interval] / 15.0)
    return Weather(
        insects=activity, wind=float(dep.weather["wind"][day]), rain=float(dep.weather["rain_now"][interval])
    )


def interval_audio(
    dep: Deployment,
    lamp: int,
    interval: int,
    audio: AudioConfig,
    seconds: float,
    offset_s: float = 0.0,
    zap_times: np.ndarray | None = None,
):
    """(audio, true zap times) of ``seconds`` of one interval at one lamp, from ``offset_s`` into it.

    ``zap_times`` (s into the interval): the zaps sounding at the lamp in place of its own
    kills (an attacker's loudspeaker, ``attacks.forged_zaps``); the background is the same."""
    from tessera.apps.sil_fdia.attacks import check_lamps

    check_lamps(dep, [lamp])
    if not 0 <= interval < dep.config.num_intervals:
        raise ValueError(
            f"interval {interval} is outside the simulated period 0..{dep.config.num_intervals - 1}"
        )
    if not 0 <= offset_s and offset_s + seconds <= dep.config.interval_s:
        raise ValueError(
            f"audio window {offset_s} s + {seconds} s does not fit in a {dep.config.interval_s} s interval"
        )
    own = dep.kill_times[lamp][interval] if zap_times is None else np.asarray(zap_times, dtype=float)
    times = own - offset_s
    times = times[
        (times >= 0) & (times < seconds - 0.03)
    ]  # a zap cut off by the recording's end is not counted
    seed = int(
        np.random.SeedSequence([audio.seed, dep.config.seed, lamp, interval, int(offset_s)]).generate_state(
            1
        )[0]
    )
    clip = synthesize(
        seconds, times, interval_weather(dep, lamp, interval), audio.snr_db, seed, audio.sample_rate
    )
    return clip, times


@dataclass
class Heard:
    """(lamps, intervals) what the recorder made of each interval listened to (NaN elsewhere):
    zaps counted, onsets rejected per second (rain clicks) and the zap band's floor (dB)."""

    counts: np.ndarray
    rejected: np.ndarray
    level: np.ndarray

    def rainy(self) -> np.ndarray:
        """Intervals in which the recorder hears rain: raindrops are many rejected onsets a
        second (tens), a dry night's hum and wind well under one."""
        return np.nan_to_num(self.rejected) > RAIN_REJECTED_PER_S


RAIN_REJECTED_PER_S = 5.0
# the variance's floors (a, b): a fit on few intervals can come out near 0 or negative, and
# a model that thinks one miss impossible calls every miss an attack (a: half a zap's sd)
VAR_FLOOR = (0.25, 0.02)


def _heard_lamp(
    dep: Deployment,
    lamp: int,
    intervals: np.ndarray,
    audio: AudioConfig,
    listen: Listening,
    forged: dict | None = None,
):
    night = dep.night_mask()
    out = np.full((3, intervals.size), np.nan)
    for i, k in enumerate(intervals):
        seconds = listen.night_s if night[k] else listen.day_s
        zap_times = (forged or {}).get((lamp, int(k)))
        clip, _ = interval_audio(dep, lamp, int(k), audio, seconds, zap_times=zap_times)
        times, rejected, level = hear_clip(clip, audio.sample_rate)
        out[:, i] = times.size, rejected, level
    return out


def heard_counts(
    dep: Deployment, audio: AudioConfig, listen: Listening, intervals: np.ndarray, workers: int = 1
) -> Heard:
    """What the recorder hears at every lamp in ``intervals`` (NaN for intervals not listened to)."""
    return hear_many([(dep, audio, intervals)], listen, workers)[0]


def hear_many(
    jobs: list[tuple[Deployment, AudioConfig, np.ndarray]], listen: Listening, workers: int = 1
) -> list[Heard]:
    """``heard_counts`` of several deployments, their lamps spread over ``workers`` processes."""
    flat = [(dep, lamp, intervals, audio, listen) for dep, audio, intervals in jobs
            for lamp in range(dep.config.num_lamps)]  # fmt: skip
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = iter(list(pool.map(_heard_lamp, *zip(*flat, strict=True))))
    else:
        results = iter([_heard_lamp(*job) for job in flat])
    out = []
    for dep, _, intervals in jobs:
        heard = np.full((3, *dep.true_kills.shape), np.nan)
        for lamp in range(dep.config.num_lamps):
            heard[:, lamp, intervals] = next(results)
        out.append(Heard(*heard))
    return out


def hear_forged(
    dep: Deployment,
    heard: Heard,
    forged: dict[tuple[int, int], np.ndarray],
    audio: AudioConfig,
    listen: Listening,
    workers: int = 1,
) -> Heard:
    """``heard`` with every interval in ``forged`` ((lamp, interval) -> the zap times that
    sound there instead of the lamp's own) listened to again; intervals not listened to
    (NaN in ``heard``) stay so. The rest is ``heard``'s, unchanged."""
    out = Heard(heard.counts.copy(), heard.rejected.copy(), heard.level.copy())
    keys = sorted(key for key in forged if np.isfinite(heard.counts[key]))
    jobs = [
        (lamp, np.array([k for lmp, k in keys if lmp == lamp])) for lamp in sorted({lmp for lmp, _ in keys})
    ]
    # the window split in pieces, so that one target's intervals spread over the workers
    pieces = [(lamp, part) for lamp, ks in jobs for part in np.array_split(ks, max(1, workers))
              if part.size]  # fmt: skip
    args = [(dep, lamp, part, audio, listen, forged) for lamp, part in pieces]
    if workers > 1 and len(args) > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_heard_lamp, *zip(*args, strict=True)))
    else:
        results = [_heard_lamp(*a) for a in args]
    for (lamp, part), res in zip(pieces, results, strict=True):
        out.counts[lamp, part], out.rejected[lamp, part], out.level[lamp, part] = res
    return out


@dataclass
class CountModel:
    """heard ~ gain * (reported kills in the recorded part) + false(r) per second, r the
    onsets rejected per second (in rain: raindrops, fewer as the floor rises with heavier
    rain); variance ~ a + b e + c e^2 at e expected zaps.

    b is the count noise that grows like a Poisson's (misses and false zaps one by one, the
    thinning of a partial recording); c the part that grows with the count itself (a
    night's wind or a spell's rain moving the recall for many zaps at once).
    """

    gain: float
    false_per_s: float
    false_per_s_per_rejected: float  # 0 in the dry class
    ref_rejected: float
    var_a: float
    var_b: float
    var_c: float
    intervals: int  # clean intervals it was fitted on
    # the rejected onsets per second it was fitted on (+-1): it does not speak beyond them
    rejected_range: tuple[float, float] = (-np.inf, np.inf)

    def covers(self, rejected: np.ndarray) -> np.ndarray:
        r = np.nan_to_num(rejected)
        return (r >= self.rejected_range[0]) & (r <= self.rejected_range[1])

    def expected(self, x: np.ndarray, seconds: np.ndarray, rejected: np.ndarray) -> np.ndarray:
        rate = self.false_per_s + self.false_per_s_per_rejected * (
            np.nan_to_num(rejected) - self.ref_rejected
        )
        return self.gain * x + np.maximum(rate, 0.0) * seconds

    def spread(self, expected: np.ndarray) -> np.ndarray:
        return np.sqrt(self.var_a + self.var_b * expected + self.var_c * expected**2)


@dataclass
class SoundCalibration:
    """A count model for intervals in which the recorder hears no rain and one for those in
    which it does (None: too few rainy calibration intervals; rain then, and rain heavier or
    lighter than any calibration night's, carries no sound evidence). Raindrops click in the zap's band: at 15 dB light rain passes for 4-8 zaps
    an interval, heavy rain fewer but hides some, so one model for both calls every rainy
    interval an attack and a rainy count is worth a few times less than a dry one."""

    dry: CountModel
    rain: CountModel | None
    rain_intervals: int  # clean rainy intervals seen in calibration


MIN_RAIN_INTERVALS = 40


def _recorded(dep: Deployment, listen: Listening) -> tuple[np.ndarray, np.ndarray]:
    """Per interval: the share of it recorded and the seconds recorded."""
    seconds = np.where(dep.night_mask(), listen.night_s, listen.day_s)
    return seconds / dep.config.interval_s, seconds


def _fit_counts(
    x: np.ndarray, s: np.ndarray, heard: np.ndarray, rejected: np.ndarray | None = None
) -> CountModel:
    ref = float(np.mean(rejected)) if rejected is not None else 0.0
    cols = [x, s] + ([s * (rejected - ref)] if rejected is not None else [])
    coef, *_ = np.linalg.lstsq(np.column_stack(cols), heard, rcond=None)
    per_rejected = float(coef[2]) if rejected is not None else 0.0
    model = CountModel(
        float(coef[0]), float(coef[1]), per_rejected, ref, VAR_FLOOR[0], VAR_FLOOR[1], 0.0, int(x.size)
    )
    expected = model.expected(x, s, rejected if rejected is not None else np.zeros_like(x))
    design = np.column_stack([np.ones_like(x), expected, expected**2])
    (var_a, var_b, var_c), *_ = np.linalg.lstsq(design, (heard - expected) ** 2, rcond=None)
    model.var_a, model.var_b = float(max(var_a, VAR_FLOOR[0])), float(max(var_b, VAR_FLOOR[1]))
    model.var_c = float(max(var_c, 0.0))
    if rejected is not None:
        model.rejected_range = (float(rejected.min()) - 1.0, float(rejected.max()) + 1.0)
    return model


def fit_sound(pool: list[tuple[Deployment, Heard]], listen: Listening) -> SoundCalibration:
    """The count models, fitted on the clean intervals listened to in ``pool`` (deployments
    and what was heard there: their telemetry is clean, so reported = true kills)."""
    cols = {"x": [], "s": [], "h": [], "r": [], "rain": []}
    for dep, heard in pool:
        share, seconds = _recorded(dep, listen)
        mask = np.isfinite(heard.counts)
        cols["x"].append((dep.telemetry["kills"] * share)[mask])
        cols["s"].append(np.broadcast_to(seconds, mask.shape)[mask])
        cols["h"].append(heard.counts[mask])
        cols["r"].append(heard.rejected[mask])
        cols["rain"].append(heard.rainy()[mask])
    x, s, h, r, rain = (np.concatenate(cols[k]) for k in ("x", "s", "h", "r", "rain"))
    wet = _fit_counts(x[rain], s[rain], h[rain], r[rain]) if rain.sum() >= MIN_RAIN_INTERVALS else None
    return SoundCalibration(_fit_counts(x[~rain], s[~rain], h[~rain]), wet, int(rain.sum()))


def sound_z(
    dep: Deployment, tel: dict, heard: Heard, listen: Listening, calib: SoundCalibration
) -> np.ndarray:
    """(lamps, intervals): heard minus the zaps the report implies, in the count model's
    standard deviations (NaN where nothing was recorded, or in rain no calibration night
    heard like it: no evidence)."""
    share, seconds = _recorded(dep, listen)
    x = tel["kills"] * share
    seconds = np.broadcast_to(seconds, x.shape)
    rain = heard.rainy()
    z = np.full(x.shape, np.nan)
    for model, where in ((calib.dry, ~rain), (calib.rain, rain)):
        if model is None:
            continue
        where = where & model.covers(heard.rejected)
        expected = model.expected(x, seconds, heard.rejected)
        # counts are whole zaps: half a zap of the gap is rounding (a continuity correction),
        # or one false zap where 0.1 were expected reads as three standard deviations
        gap = np.nan_to_num(heard.counts) - expected
        z = np.where(where, np.sign(gap) * np.maximum(np.abs(gap) - 0.5, 0.0) / model.spread(expected), z)
    return np.where(np.isfinite(heard.counts), z, np.nan)
