"""Zaps and background at the SNR asked for; the zap detector finds zaps; WAV errors."""

import numpy as np
import pytest

from tessera.apps.sil_fdia.audio import Weather, background, read_wav, synthesize, unit_zap, write_wav
from tessera.apps.sil_fdia.zaps import detect_zaps, f1_score, match


def test_unit_zap_and_background_levels():
    rng = np.random.default_rng(0)
    for _ in range(5):
        zap = unit_zap(rng, 16000)
        # its first 5 ms has power 1, scaled so in float: approx's default 1e-6 relative
        assert np.mean(zap[:80] ** 2) == pytest.approx(1.0)
    for snr in (0.0, 10.0, 20.0):
        noise = background(160000, Weather(insects=0.5, wind=0.5, rain=0.5), snr, rng, 16000)
        # rel=1e-3: the float32 mix is scaled to that power, exact up to float32 rounding
        # (measured <= 3.2e-7 relative); 1e-3 is loose, an SNR off by 0.01 dB already fails
        assert np.mean(noise.astype(np.float64) ** 2) == pytest.approx(10 ** (-snr / 10), rel=1e-3)


def test_synthesis_is_seeded():
    zaps = np.array([0.5, 1.2, 3.3])
    a = synthesize(4.0, zaps, Weather(rain=0.4), 10.0, seed=3)
    np.testing.assert_array_equal(a, synthesize(4.0, zaps, Weather(rain=0.4), 10.0, seed=3))
    assert not np.array_equal(a, synthesize(4.0, zaps, Weather(rain=0.4), 10.0, seed=4))


def test_match_pairs_one_to_one_within_tolerance():
    assert match(np.array([1.0, 1.004, 2.5]), np.array([1.002, 2.0]), tol_s=0.01) == 1
    # one of two found, one of two true: precision = recall = 1/2; approx's default only for float rounding
    assert f1_score(np.array([1.0, 3.0]), np.array([1.001, 2.0]))["f1"] == pytest.approx(0.5)


@pytest.mark.parametrize("snr,floor", [(30.0, 0.95), (15.0, 0.9)])
def test_zap_f1_at_high_snr(snr, floor):
    rng = np.random.default_rng(11)
    zaps = np.sort(rng.uniform(0.1, 29.9, 15))
    audio = synthesize(30.0, zaps, Weather(insects=0.8, wind=0.6), snr, seed=21)
    found = detect_zaps(audio)
    assert f1_score(found, zaps)["f1"] >= floor
    silent = synthesize(30.0, np.array([]), Weather(insects=0.8, wind=0.6), snr, seed=22)
    assert detect_zaps(silent).size <= 1  # hum and wind are not zaps


def test_wav_round_trip_and_corrupt_files(tmp_path):
    audio = synthesize(2.0, np.array([0.5, 1.5]), Weather(), 20.0, seed=1)
    path = tmp_path / "clip.wav"
    scale = write_wav(path, audio, 16000)
    back, rate = read_wav(path)
    assert rate == 16000 and back.size == audio.size
    # 16-bit PCM: written as round(x / scale * 32767), read as n / 32768, so up to half a
    # step of rounding plus <= 0.99 step of the 32767/32768 gain: < 1.5 * scale / 32768
    np.testing.assert_allclose(back * scale, audio, atol=scale / 16000)
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    with pytest.raises(ValueError, match=r"audio file .*bad.wav is corrupt") as info:
        read_wav(bad)
    assert "\n" not in str(info.value)
    truncated = tmp_path / "cut.wav"
    truncated.write_bytes(path.read_bytes()[:45])
    with pytest.raises(ValueError, match="cut.wav is corrupt"):
        read_wav(truncated)
