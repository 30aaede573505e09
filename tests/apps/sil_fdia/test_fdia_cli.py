"""`tessera fdia ...`: outputs written, and every bad input is one line on stderr, exit 2."""

import pytest

from tessera.cli import main


def test_simulate_writes_csv_plots_and_wav(tmp_path, capsys):
    out = tmp_path / "sim"
    code = main(["fdia", "simulate", "--lamps", "2", "--days", "2", "--attack", "scale", "--start-h", "32",
                 "--end-h", "36", "--targets", "1", "--audio-seconds", "5", "--out", str(out)])  # fmt: skip
    assert code == 0
    for name in ("telemetry.csv", "telemetry.png", "zaps.wav", "spectrogram.png", "attack.json"):
        assert (out / name).stat().st_size > 0
    assert "reports changed by scale" in capsys.readouterr().out
    code = main(["fdia", "detect", "--audio", str(out / "zaps.wav"), "--plot", str(tmp_path / "s.png")])
    assert code == 0 and "zaps in 5.0 s" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["simulate", "--days", "2", "--attack", "flood"], "unknown attack 'flood'"),
        (
            ["simulate", "--days", "2", "--attack", "zero", "--start-h", "40", "--end-h", "60"],
            "outside the simulated period",
        ),
        (
            [
                "simulate",
                "--days",
                "2",
                "--attack",
                "zero",
                "--start-h",
                "30",
                "--end-h",
                "34",
                "--targets",
                "5",
            ],
            "unknown lamp id 5",
        ),
        (
            [
                "simulate",
                "--days",
                "2",
                "--attack",
                "zero",
                "--start-h",
                "30",
                "--end-h",
                "34",
                "--targets",
                "a",
            ],
            "unknown lamp id",
        ),
        (["detect", "--attack", "scale", "--start-h", "10", "--end-h", "14"], "outside the test day"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    assert main(["fdia", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_corrupt_audio_is_one_line(tmp_path, capsys):
    bad = tmp_path / "x.wav"
    bad.write_bytes(b"not a wav at all")
    assert main(["fdia", "detect", "--audio", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "x.wav is corrupt" in err and err.count("\n") == 1
