"""The applications' subcommands: `tessera fdia simulate | detect | bench` (SIL-IoT false
data injection) and `tessera robust attack` (ROCBERT). Parsers and handlers only; the work
is in tessera.apps."""

from __future__ import annotations

import argparse


def add_app_parsers(sub, positive_int, bench) -> None:
    """``bench``: the `tessera bench` handler (`fdia bench` is the same command)."""
    _add_fdia_parser(sub, positive_int, bench)
    _add_robust_parser(sub, positive_int)


# ---- fdia --------------------------------------------------------------------------------


def cmd_fdia(args: argparse.Namespace, bench) -> None:
    from tessera.apps.sil_fdia import commands

    if args.fdia_command == "bench":
        args.name = "fdia"
        return bench(args)
    run = commands.simulate_command if args.fdia_command == "simulate" else commands.detect_command
    print(run(args))


def _add_fdia_parser(sub, positive_int, bench) -> None:
    p = sub.add_parser(
        "fdia", help="false data injection on solar insecticidal lamps: simulate | detect | bench"
    )
    fdia = p.add_subparsers(dest="fdia_command", required=True)
    for name, text in (
        (
            "simulate",
            "simulate a deployment (optionally attacked): CSV, telemetry plot, a WAV clip and its spectrogram",
        ),
        (
            "detect",
            "score an attack with the telemetry, sound and fused detectors, or count zaps in --audio FILE.wav",
        ),
    ):
        q = fdia.add_parser(name, help=text)
        q.add_argument("--lamps", type=positive_int, default=4)
        q.add_argument("--seed", type=int, default=0)
        q.add_argument(
            "--attack", help="scale, additive, replay, constant, zero, daytime, battery or stealthy"
        )
        q.add_argument("--start-h", type=float, default=80.0, help="attack start, hours after noon of day 0")
        q.add_argument("--end-h", type=float, default=86.0, help="attack end, hours after noon of day 0")
        q.add_argument("--targets", default="0", help="attacked lamp ids, e.g. 0,2")
        q.add_argument(
            "--magnitude", type=float, help="factor / offset / days back / value (default per kind)"
        )
        q.add_argument("--snr-db", type=float, default=15.0, help="a median zap against the background")
        q.add_argument("--out", default="runs/fdia", help="folder for the CSV, WAV and plots")
        if name == "simulate":
            q.add_argument("--days", type=positive_int, default=4)
            q.add_argument("--audio-seconds", type=float, default=30.0, help="length of the WAV clip")
        else:
            q.add_argument(
                "--listen-s",
                type=float,
                default=600.0,
                help="seconds recorded per 10-min night interval (default 600: all of it, as the bench; "
                "at 60 the sound hears a tenth of the zaps and misses attacks that keep the counts' statistics)",
            )
            q.add_argument("--workers", type=positive_int, default=2, help="processes listening to the audio")
            q.add_argument("--audio", help="a mono 16-bit 16 kHz WAV: count its zaps instead")
            q.add_argument("--plot", help="with --audio: write its spectrogram with the zaps marked here")
        q.set_defaults(handler=lambda args: cmd_fdia(args, bench))
    q = fdia.add_parser("bench", help="the same as `tessera bench fdia`")
    q.add_argument("--quick", action="store_true", help="small version, under two minutes on 2 cores")
    q.add_argument("--out", default="benchmarks/results", help="folder for fdia.json / .md / .png")
    q.set_defaults(handler=lambda args: cmd_fdia(args, bench))


def cmd_robust(args: argparse.Namespace) -> None:
    from tessera.apps.rocbert.commands import attack_command

    print(attack_command(args))


def _add_robust_parser(sub, positive_int) -> None:
    p = sub.add_parser("robust", help="ROCBERT robust Chinese classification: attack a trained model")
    robust = p.add_subparsers(dest="robust_command", required=True)
    q = robust.add_parser("attack", help="show synthetic attacks of --text and the model's predictions")
    q.add_argument("--model", required=True, help="folder from `tessera train --recipe rocbert-sentiment`")
    q.add_argument("--text", action="append", required=True, help="a Chinese text (repeatable)")
    q.add_argument("--variants", type=positive_int, default=5, help="synthetic attacked copies per text")
    q.add_argument("--query-budget", type=positive_int, default=200, help="each greedy black-box attack's queries")
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(handler=cmd_robust)
