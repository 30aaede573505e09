"""16 kHz sound beside a lamp: discharge zaps over insect hum, wind and rain.

Zap model (one discharge of the high-voltage grid through an insect): a broadband crack,
white noise under an exponential decay of time constant ``CRACK_TAU_S`` (0.3-1.0 ms,
uniform), plus a damped ringing of the grid's wires near ``RING_HZ`` (4.2 kHz +- 300 Hz,
decay 2 ms, 0.5 of the crack's amplitude); with probability ``RESTRIKE_P`` a larger insect
is struck again 2-15 ms later at 0.3-0.8 of the amplitude. Each unit zap is scaled so that
its power over its first 5 ms is 1; its amplitude is log-normal (sigma 0.5) around 1 for
the insect's size and distance. So a median zap has power 1, and the background is scaled
to power ``10 ** (-snr_db / 10)``: ``snr_db`` is the median zap's 5 ms power against the
background's.

Background (shares of its power, set by the interval's weather): a sensor floor (white),
insect hum (wing-beat harmonics of a fundamental between 180 and 600 Hz, slowly
modulated; louder when more insects fly), wind (white noise through a 300 Hz low-pass
under a slow gust envelope), rain (Poisson clicks, 1000 per second per unit of rain, each a
0.3 ms decaying oscillation with log-normal size and random sign).
"""

from __future__ import annotations

import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import signal

CRACK_TAU_S = (0.3e-3, 1.0e-3)
RING_HZ, RING_SPREAD_HZ, RING_TAU_S, RING_GAIN = 4200.0, 300.0, 2e-3, 0.5
RESTRIKE_P, RESTRIKE_GAP_S, RESTRIKE_GAIN = 0.3, (2e-3, 15e-3), (0.3, 0.8)
ZAP_LEN_S = 0.03
AMPLITUDE_SIGMA = 0.5
RAIN_CLICKS_PER_S, RAIN_CLICK_S = 1000.0, 0.3e-3


@dataclass(frozen=True, kw_only=True)
class Weather:
    """What the background is made of during one interval (each in [0, 1])."""

    insects: float = 0.5
    wind: float = 0.3
    rain: float = 0.0


def unit_zap(rng: np.random.Generator, sample_rate: int) -> np.ndarray:
    """One zap with its power over the first 5 ms equal to 1."""
    t = np.arange(int(ZAP_LEN_S * sample_rate)) / sample_rate
    crack = rng.standard_normal(t.size) * np.exp(-t / rng.uniform(*CRACK_TAU_S))
    ring_hz = RING_HZ + RING_SPREAD_HZ * rng.standard_normal()
    ring = RING_GAIN * np.sin(2 * np.pi * ring_hz * t + rng.uniform(0, 2 * np.pi)) * np.exp(-t / RING_TAU_S)
    zap = crack + ring
    if rng.random() < RESTRIKE_P:
        shift = int(rng.uniform(*RESTRIKE_GAP_S) * sample_rate)
        tail = rng.standard_normal(t.size - shift) * np.exp(-t[: t.size - shift] / rng.uniform(*CRACK_TAU_S))
        zap[shift:] += rng.uniform(*RESTRIKE_GAIN) * tail
    head = zap[: int(5e-3 * sample_rate)]
    return zap / np.sqrt(np.mean(head**2))


def add_zaps(audio: np.ndarray, times_s: np.ndarray, rng: np.random.Generator, sample_rate: int) -> None:
    for time in times_s:
        zap = unit_zap(rng, sample_rate) * rng.lognormal(0.0, AMPLITUDE_SIGMA)
        start = int(round(time * sample_rate))
        end = min(audio.size, start + zap.size)
        if 0 <= start < audio.size:
            audio[start:end] += zap[: end - start]


def _stretch(coarse: np.ndarray, step: int, n: int) -> np.ndarray:
    """Linear interpolation of ``coarse`` by an integer factor, cut to ``n`` samples."""
    ramp = np.arange(step, dtype=np.float32) / np.float32(step)
    fine = coarse[:-1, None] + (coarse[1:] - coarse[:-1])[:, None] * ramp[None, :]
    return fine.ravel()[:n]


def _slow(n: int, rate_hz: float, rng: np.random.Generator, sample_rate: int) -> np.ndarray:
    """Unit white noise at ``rate_hz``, linearly interpolated to ``n`` samples (a slow wander)."""
    step = int(round(sample_rate / rate_hz))
    return _stretch(rng.standard_normal(n // step + 2).astype(np.float32), step, n)


def _hum(n: int, rng: np.random.Generator, sample_rate: int) -> np.ndarray:
    f0 = rng.uniform(180.0, 600.0)
    wander = _slow(n, 10.0, rng, sample_rate)
    phase = np.cumsum(np.float32(2 * np.pi * f0 / sample_rate) * (1 + np.float32(0.03) * wander))
    s, c = np.sin(phase), np.cos(phase)
    # the 2nd and 3rd wing-beat harmonics from the identities sin 2x = 2 s c, sin 3x = 3 s - 4 s^3
    hum = s * (np.float32(1.75) + c - s * s)  # = s + 0.5 (2 s c) + 0.25 (3 s - 4 s^3)
    return hum * (1 + np.float32(0.5) * np.tanh(wander))


def _wind(n: int, rng: np.random.Generator, sample_rate: int) -> np.ndarray:
    # low-passed noise made at a quarter of the rate (all of it is under 300 Hz), then stretched
    sos = signal.butter(2, 300.0, fs=sample_rate / 4, output="sos")
    coarse = signal.sosfilt(sos, rng.standard_normal(n // 4 + 2)).astype(np.float32)
    noise = _stretch(coarse, 4, n)
    return noise * np.exp(np.float32(0.7) * _slow(n, 2.0, rng, sample_rate))


def _rain(n: int, rain: float, rng: np.random.Generator, sample_rate: int) -> np.ndarray:
    count = rng.poisson(RAIN_CLICKS_PER_S * rain * n / sample_rate)
    taps = max(2, int(RAIN_CLICK_S * sample_rate))
    # drops land at random times with log-normal sizes and either sign; each rings for 0.3 ms
    impulses = np.bincount(
        rng.integers(0, n, count),
        weights=rng.lognormal(0.0, 0.6, count) * rng.choice((-1.0, 1.0), count),
        minlength=n,
    ).astype(np.float32)
    shape = (np.exp(-np.arange(taps) / (taps / 3)) * np.cos(np.pi * np.arange(taps) / 2)).astype(np.float32)
    return np.convolve(impulses, shape)[:n]


def _unit_power(x: np.ndarray) -> np.ndarray:
    power = float(np.dot(x, x)) / max(x.size, 1)
    return x * np.float32(1 / np.sqrt(power)) if power > 0 else x


def background(
    n: int, weather: Weather, snr_db: float, rng: np.random.Generator, sample_rate: int
) -> np.ndarray:
    """``n`` samples of hum + wind + rain + sensor floor with total power 10**(-snr_db/10)."""
    shares = {"floor": 0.05, "hum": 0.1 + 0.4 * weather.insects, "wind": 0.05 + 0.6 * weather.wind}
    parts = {
        "floor": rng.standard_normal(n, dtype=np.float32),
        "hum": _hum(n, rng, sample_rate),
        "wind": _wind(n, rng, sample_rate),
    }
    if weather.rain > 0:
        shares["rain"] = 0.8 * weather.rain
        parts["rain"] = _rain(n, weather.rain, rng, sample_rate)
    total = sum(shares.values())
    mix = np.zeros(n, dtype=np.float32)
    for key, part in parts.items():
        mix += np.float32(np.sqrt(shares[key] / total)) * _unit_power(part)
    # the parts are independent but not exactly orthogonal over a short clip: scale the sum itself
    return _unit_power(mix) * np.float32(10 ** (-snr_db / 20))


def synthesize(
    duration_s: float,
    zap_times_s: np.ndarray,
    weather: Weather,
    snr_db: float,
    seed: int,
    sample_rate: int = 16000,
) -> np.ndarray:
    """Audio of ``duration_s`` seconds with a zap at each of ``zap_times_s`` (float32)."""
    rng = np.random.default_rng(seed)
    audio = background(int(round(duration_s * sample_rate)), weather, snr_db, rng, sample_rate)
    add_zaps(audio, np.asarray(zap_times_s, dtype=float), rng, sample_rate)
    return audio


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> float:
    """16-bit PCM; returns the scale used (audio is divided by it) so levels can be restored."""
    scale = float(max(np.max(np.abs(audio)), 1e-9) / 0.99)
    pcm = np.clip(np.round(audio / scale * 32767), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())
    return scale


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Mono 16-bit PCM as float in [-1, 1]; a file that is not one is a one-line ValueError."""
    try:
        with wave.open(str(path), "rb") as src:
            if src.getnchannels() != 1 or src.getsampwidth() != 2:
                raise ValueError(
                    f"audio file {path}: expected mono 16-bit PCM, got {src.getnchannels()} channel(s) "
                    f"of {8 * src.getsampwidth()} bits"
                )
            rate, frames = src.getframerate(), src.readframes(src.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"audio file {path} is corrupt or not a WAV file ({exc})") from None
    if len(frames) % 2 or not frames:
        raise ValueError(f"audio file {path} is corrupt: {len(frames)} bytes of sample data")
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0, rate
