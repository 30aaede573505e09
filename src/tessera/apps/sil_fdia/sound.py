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
from tessera.apps.sil_fdia.zaps import detect_zaps

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
    dep: Deployment, lamp: int, interval: int, audio: AudioConfig, seconds: float, offset_s: float = 0.0
):
    """(audio, true zap times) of ``seconds`` of one interval at one lamp, from ``offset_s`` into it."""
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
    times = dep.kill_times[lamp][interval] - offset_s
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


def _heard_lamp(dep: Deployment, lamp: int, intervals: np.ndarray, audio: AudioConfig, listen: Listening):
    night = dep.night_mask()
    out = np.full(intervals.size, np.nan)
    for i, k in enumerate(intervals):
        seconds = listen.night_s if night[k] else listen.day_s
        clip, _ = interval_audio(dep, lamp, int(k), audio, seconds)
        out[i] = detect_zaps(clip, audio.sample_rate).size
    return out


def heard_counts(
    dep: Deployment, audio: AudioConfig, listen: Listening, intervals: np.ndarray, workers: int = 1
) -> np.ndarray:
    """(lamps, intervals) zaps heard (NaN for intervals not listened to)."""
    heard = np.full(dep.true_kills.shape, np.nan)
    jobs = [(dep, lamp, intervals, audio, listen) for lamp in range(dep.config.num_lamps)]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_heard_lamp, *zip(*jobs, strict=True)))
    else:
        results = [_heard_lamp(*job) for job in jobs]
    for lamp, counts in enumerate(results):
        heard[lamp, intervals] = counts
    return heard


@dataclass
class SoundCalibration:
    """heard ~ gain * (reported kills in the recorded part) + false per second;
    variance ~ a + b * expected + c * expected**2.

    b is the count noise that grows like a Poisson's (misses and false zaps one by one, and
    the thinning when only part of an interval is recorded); c is the night-to-night part
    that grows with the count itself: rain or wind lowers the zap detector's recall for a
    whole spell, so a busy rainy interval misses several zaps at once. Without c a scale
    fitted on one dry night calls every busy rainy interval an attack.
    """

    gain: float
    false_per_s: float
    var_a: float
    var_b: float
    var_c: float


def _recorded_share(dep: Deployment, listen: Listening) -> np.ndarray:
    night = dep.night_mask()
    return np.where(night, listen.night_s, listen.day_s) / dep.config.interval_s, np.where(
        night, listen.night_s, listen.day_s
    )


def fit_sound(
    dep: Deployment, tel: dict, heard: np.ndarray, listen: Listening, clean: np.ndarray
) -> SoundCalibration:
    share, seconds = _recorded_share(dep, listen)
    mask = clean & np.isfinite(heard)
    x = (tel["kills"] * share)[mask]
    s = np.broadcast_to(seconds, heard.shape)[mask]
    (gain, false_per_s), *_ = np.linalg.lstsq(np.column_stack([x, s]), heard[mask], rcond=None)
    expected = gain * x + false_per_s * s
    resid2 = (heard[mask] - expected) ** 2
    design = np.column_stack([np.ones_like(x), expected, expected**2])
    (var_a, var_b, var_c), *_ = np.linalg.lstsq(design, resid2, rcond=None)
    # floors: a quarter count of rounding noise, a twentieth of a Poisson's spread, none
    # between nights (a least-squares fit on few clean nights can come out negative)
    return SoundCalibration(
        float(gain), float(max(false_per_s, 0.0)), float(max(var_a, 0.25)), float(max(var_b, 0.05)),
        float(max(var_c, 0.0)),
    )  # fmt: skip


def sound_spread(calib: SoundCalibration, expected: np.ndarray) -> np.ndarray:
    """The standard deviation of the heard count where ``expected`` zaps are expected."""
    return np.sqrt(calib.var_a + calib.var_b * expected + calib.var_c * expected**2)


def ewma(x: np.ndarray, alpha: float = 0.3) -> np.ndarray:
    """Causal exponentially weighted mean along the interval axis."""
    out = np.empty_like(x)
    acc = np.zeros(x.shape[0])
    for k in range(x.shape[1]):
        acc = alpha * x[:, k] + (1 - alpha) * acc
        out[:, k] = acc
    return out


def sound_features(
    dep: Deployment, tel: dict, heard: np.ndarray, listen: Listening, calib: SoundCalibration
) -> np.ndarray:
    """(lamps, intervals, len(SOUND_NAMES)): how far the heard count is from what the report implies."""
    share, seconds = _recorded_share(dep, listen)
    expected = calib.gain * tel["kills"] * share + calib.false_per_s * seconds
    z = (np.nan_to_num(heard, nan=0.0) - expected) / sound_spread(calib, expected)
    z = np.where(np.isfinite(heard), z, 0.0)
    return np.stack([z, np.abs(z), ewma(z), ewma(np.abs(z))], axis=-1)
