"""Counting discharges in audio: onsets of high-band energy, spectral features of each
onset, and a small gradient-boosted classifier (scikit-learn) that tells zaps from rain
clicks, gusts and hum, trained on synthetic clips of its own (separate seeds).

Frames are 4 ms (64 samples at 16 kHz) with a 2 ms hop. A candidate is a frame whose
2.5-8 kHz energy is ``ONSET_RATIO`` times the median of its second and the largest within
+-10 ms.
"""

from __future__ import annotations

import functools

import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier

from tessera.apps.sil_fdia.audio import Weather, synthesize

FRAME, HOP = 64, 32
BANDS_HZ = ((0, 1000), (1000, 2500), (2500, 3600), (3600, 4800), (4800, 8001))  # 3: the grid's ring
ONSET_RATIO = 4.0
NMS_FRAMES = 5  # +-10 ms
MATCH_TOL_S = 0.010
NUM_FEATURES = 5 + 3 + 4 + 3 + 2


def _frames(audio: np.ndarray) -> np.ndarray:
    count = max(0, (audio.size - FRAME) // HOP + 1)
    shape, strides = (count, FRAME), (audio.strides[0] * HOP, audio.strides[0])
    return np.lib.stride_tricks.as_strided(audio, shape=shape, strides=strides)


def band_energies(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """(frames, bands) energy of each 4 ms frame in each band of ``BANDS_HZ``."""
    spec = np.abs(np.fft.rfft(_frames(audio) * np.hanning(FRAME).astype(np.float32), axis=1)) ** 2
    freqs = np.fft.rfftfreq(FRAME, 1 / sample_rate)
    return np.stack([spec[:, (freqs >= lo) & (freqs < hi)].sum(axis=1) for lo, hi in BANDS_HZ], axis=1)


def _floor(energy: np.ndarray, per_block: int) -> np.ndarray:
    """The median of each block of ``per_block`` frames, repeated to every frame."""
    blocks = -(-energy.size // per_block)
    padded = np.pad(energy, (0, blocks * per_block - energy.size), mode="edge").reshape(blocks, per_block)
    return np.repeat(np.median(padded, axis=1), per_block)[: energy.size] + 1e-12


def candidates(
    audio: np.ndarray, sample_rate: int, floor: list | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Onset frame indices and a (candidates, features) matrix; appends the clip's median
    2.5-8 kHz frame energy (dB) to ``floor`` if given."""
    bands = band_energies(audio, sample_rate)
    if bands.shape[0] < 2 * NMS_FRAMES + 1:
        return np.zeros(0, dtype=int), np.zeros((0, NUM_FEATURES))
    high = bands[:, 2:].sum(axis=1)
    floors = np.stack([_floor(bands[:, b], sample_rate // HOP) for b in range(bands.shape[1])], axis=1)
    high_floor = floors[:, 2:].sum(axis=1)
    if floor is not None:
        floor.append(float(10 * np.log10(np.median(high) + 1e-12)))
    ratio = high / high_floor
    window = np.lib.stride_tricks.sliding_window_view(np.pad(high, NMS_FRAMES), 2 * NMS_FRAMES + 1)
    peaks = np.flatnonzero((ratio > ONSET_RATIO) & (high >= window.max(axis=1)))
    return peaks, _features(peaks, bands, floors, high, high_floor)


def _features(peaks, bands, floors, high, high_floor) -> np.ndarray:
    def at(k: int) -> np.ndarray:
        return np.clip(peaks + k, 0, high.size - 1)

    logr = np.log10(bands[peaks] / floors[peaks])  # how far above its band's floor, per band
    share = bands[peaks] / (bands[peaks].sum(axis=1, keepdims=True) + 1e-12)
    tail = [np.log10((high[at(k)] + 1e-12) / (high[peaks] + 1e-12)) for k in (1, 2, 4, 8)]  # 2-16 ms decay
    # the grid's wires ring on for milliseconds after the crack; a raindrop's click does not
    ring = [np.log10((bands[at(k), 3] + 1e-12) / (floors[peaks, 3] + 1e-12)) for k in (1, 2, 3)]
    before = np.log10((high[at(-3)] + 1e-12) / (high[peaks] + 1e-12))  # the rise over 6 ms
    level = np.log10(high[peaks] / high_floor[peaks])
    return np.column_stack([logr, share[:, 2:], *tail, *ring, before, level])


def match(detected_s: np.ndarray, truth_s: np.ndarray, tol_s: float = MATCH_TOL_S) -> int:
    """True positives: detections paired one-to-one with a true zap within ``tol_s``."""
    detected_s, truth_s = np.sort(detected_s), np.sort(truth_s)
    i = j = hits = 0
    while i < detected_s.size and j < truth_s.size:
        gap = detected_s[i] - truth_s[j]
        if abs(gap) <= tol_s:
            hits, i, j = hits + 1, i + 1, j + 1
        elif gap < 0:
            i += 1
        else:
            j += 1
    return hits


def f1_score(detected_s: np.ndarray, truth_s: np.ndarray, tol_s: float = MATCH_TOL_S) -> dict[str, float]:
    hits = match(detected_s, truth_s, tol_s)
    precision = hits / detected_s.size if detected_s.size else float(truth_s.size == 0)
    recall = hits / truth_s.size if truth_s.size else float(detected_s.size == 0)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def _training_clip(k: int, rng: np.random.Generator, sample_rate: int) -> tuple[np.ndarray, np.ndarray]:
    duration = 30.0
    zaps = np.sort(rng.uniform(0.05, duration - 0.05, rng.integers(0, 40)))
    weather = Weather(insects=rng.uniform(), wind=rng.uniform(), rain=rng.uniform() * (rng.random() < 0.5))
    audio = synthesize(
        duration, zaps, weather, rng.uniform(0.0, 30.0), seed=10_000 + k, sample_rate=sample_rate
    )
    return audio, zaps


@functools.lru_cache(maxsize=4)
def trained_classifier(
    seed: int = 12345, clips: int = 60, sample_rate: int = 16000
) -> HistGradientBoostingClassifier:
    """The candidate classifier, fitted on ``clips`` synthetic 30 s clips at 0-30 dB SNR."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for k in range(clips):
        audio, zaps = _training_clip(k, rng, sample_rate)
        peaks, feats = candidates(audio, sample_rate)
        times = peaks * HOP / sample_rate
        nearest = (
            np.min(np.abs(times[:, None] - zaps[None, :]), axis=1) if zaps.size else np.full(times.size, 1.0)
        )
        xs.append(feats)
        ys.append(nearest <= MATCH_TOL_S)
    model = HistGradientBoostingClassifier(max_iter=150, learning_rate=0.1, random_state=0)
    return model.fit(np.concatenate(xs), np.concatenate(ys))


def listen(
    audio: np.ndarray, sample_rate: int = 16000, threshold: float = 0.5
) -> tuple[np.ndarray, float, float]:
    """(times (s) of the zaps heard in ``audio``, onsets the classifier rejected per second,
    the median 2.5-8 kHz frame energy in dB).

    The last two are what the recorder hears of the weather: raindrops click in the zap's
    band and raise its floor, and the same rain hides zaps or passes for them (the sound's
    count model is fitted per weather class).
    """
    if sample_rate != 16000:
        raise ValueError(f"the zap detector is trained on 16000 Hz audio, got {sample_rate} Hz")
    floor: list[float] = []
    peaks, feats = candidates(np.ascontiguousarray(audio, dtype=np.float32), sample_rate, floor)
    level = floor[0] if floor else float("nan")
    if peaks.size == 0:
        return np.zeros(0), 0.0, level
    keep = trained_classifier(sample_rate=sample_rate).predict_proba(feats)[:, 1] >= threshold
    # the onset frame starts up to a hop before the crack: report the frame's centre
    rejected = float((~keep).sum() / (audio.size / sample_rate))
    return (peaks[keep] * HOP + FRAME / 2) / sample_rate, rejected, level


def detect_zaps(audio: np.ndarray, sample_rate: int = 16000, threshold: float = 0.5) -> np.ndarray:
    """Times (s) of the zaps heard in ``audio``."""
    return listen(audio, sample_rate, threshold)[0]
