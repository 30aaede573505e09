"""`tessera fdia simulate | detect | bench`: what the command line calls (it only parses)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from tessera.apps.sil_fdia.attacks import Attack, apply_attack, check_lamps
from tessera.apps.sil_fdia.audio import read_wav, write_wav
from tessera.apps.sil_fdia.config import AudioConfig, SimConfig
from tessera.apps.sil_fdia.simulate import FIELDS, simulate
from tessera.apps.sil_fdia.sound import interval_audio
from tessera.apps.sil_fdia.zaps import detect_zaps, f1_score


def parse_lamps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(
            f"unknown lamp id in {text!r}; give lamp numbers separated by commas, e.g. 0,2"
        ) from None


def _attack(args, dep) -> tuple[dict, np.ndarray, Attack | None]:
    if not args.attack:
        return dep.telemetry, np.zeros(dep.true_kills.shape, dtype=bool), None
    attack = Attack(kind=args.attack, start_h=args.start_h, end_h=args.end_h, lamps=parse_lamps(args.targets),
                    magnitude=args.magnitude, seed=args.seed)  # fmt: skip
    tel, changed = apply_attack(dep, attack)
    return tel, changed, attack


def write_csv(path: Path, dep, tel: dict, changed: np.ndarray) -> None:
    hours = np.arange(dep.config.num_intervals) * dep.config.interval_s / 3600.0
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["lamp", "interval", "hours", *FIELDS, "true_kills", "attacked"])
        for lamp in range(dep.config.num_lamps):
            for k in range(dep.config.num_intervals):
                values = [f"{tel[f][lamp, k]:.4f}" for f in FIELDS]
                writer.writerow(
                    [lamp, k, f"{hours[k]:.3f}", *values, dep.true_kills[lamp, k], int(changed[lamp, k])]
                )


def busiest_interval(dep, lamp: int) -> int:
    return int(np.argmax(dep.true_kills[lamp]))


def _busiest_window(times: np.ndarray, seconds: float, interval_s: float) -> float:
    """The whole-second offset at which a ``seconds`` long clip holds the most zaps."""
    if seconds >= interval_s:
        return 0.0
    starts = np.arange(0.0, interval_s - seconds + 1e-9, 1.0)
    counts = [np.sum((times >= t) & (times < t + seconds - 0.03)) for t in starts]
    return float(starts[int(np.argmax(counts))])


def simulate_command(args) -> str:
    from tessera.apps.sil_fdia.plots import plot_spectrogram, plot_telemetry

    dep = simulate(SimConfig(num_lamps=args.lamps, num_days=args.days, seed=args.seed))
    tel, changed, attack = _attack(args, dep)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "telemetry.csv", dep, tel, changed)
    lamp = attack.lamps[0] if attack else 0
    window = (attack.start_h, attack.end_h) if attack else None
    plot_telemetry(dep, tel, changed, lamp, out / "telemetry.png", window=window)
    interval = busiest_interval(dep, lamp)
    audio = AudioConfig(snr_db=args.snr_db, seed=args.seed)
    offset = _busiest_window(dep.kill_times[lamp][interval], args.audio_seconds, dep.config.interval_s)
    clip, true_s = interval_audio(dep, lamp, interval, audio, args.audio_seconds, offset)
    write_wav(out / "zaps.wav", clip, audio.sample_rate)
    found = detect_zaps(clip, audio.sample_rate)
    plot_spectrogram(clip, audio.sample_rate, found, out / "spectrogram.png", true_s,
                     title=f"lamp {lamp}, interval {interval}, {args.snr_db:g} dB")  # fmt: skip
    (out / "attack.json").write_text(json.dumps(attack.__dict__ if attack else None) + "\n")
    f1 = f1_score(found, true_s)["f1"]
    return (
        f"simulated {args.lamps} lamps x {args.days} days ({dep.true_kills.sum()} kills); "
        f"{int(changed.sum())} reports changed by {attack.kind if attack else 'no attack'}; "
        f"{args.audio_seconds:g} s of audio at lamp {lamp} (interval {interval}, from {offset:g} s): {true_s.size} zaps, {found.size} detected (F1 {f1:.2f}); "
        f"wrote {out}/telemetry.csv, telemetry.png, zaps.wav, spectrogram.png"
    )


def detect_audio(path: str, plot: str | None) -> str:
    from tessera.apps.sil_fdia.plots import plot_spectrogram

    audio, rate = read_wav(path)
    found = detect_zaps(audio, rate)
    if plot:
        plot_spectrogram(audio, rate, found, plot, title=f"{path}: {found.size} zaps detected")
    times = ", ".join(f"{t:.3f}" for t in found[:20]) + (" ..." if found.size > 20 else "")
    return f"{found.size} zaps in {audio.size / rate:.1f} s of {path}: at {times or '-'} s" + (
        f"; wrote {plot}" if plot else ""
    )


# the `tessera fdia detect` example docs/fdia.md shows (its --out aside): the bench runs it
DOCUMENTED_DETECT = [
    "fdia",
    "detect",
    "--attack",
    "stealthy",
    "--start-h",
    "80",
    "--end-h",
    "86",
    "--targets",
    "1",
]
# the detector's day plan of `tessera fdia detect`: days 0-1 fit the telemetry's constants,
# day 2 its clean scores, day 3 (hours 72-96) is the test day the attack must fall in
DETECT_DAYS = {"train_days": 2, "calib_days": 1, "test_days": 1}
TEST_HOURS = (72.0, 96.0)


def detect_plan(args):
    """The ExperimentPlan `tessera fdia detect` runs: the bench's listening and SNR unless
    the flags say otherwise, two 1-lamp nights of other seeds for the sound's calibration."""
    from tessera.apps.sil_fdia.experiment import ExperimentPlan

    return ExperimentPlan(num_lamps=args.lamps, **DETECT_DAYS, seed=args.seed, snr_db=args.snr_db,
                          listen_night_s=args.listen_s, listen_day_s=10.0, scenarios_per_kind=1, targets=1,
                          workers=args.workers, sound_seeds=(args.seed + 101, args.seed + 102),
                          sound_nights=1)  # fmt: skip


def detect_attack(args) -> Attack:
    if not args.attack:
        raise ValueError("fdia detect needs --attack KIND (or --audio FILE.wav)")
    if not (TEST_HOURS[0] <= args.start_h < args.end_h <= TEST_HOURS[1]):
        raise ValueError(
            f"attack window {args.start_h} h to {args.end_h} h is outside the test day {TEST_HOURS[0]:g} h to "
            f"{TEST_HOURS[1]:g} h (days 0-1 fit the telemetry's constants, day 2 its clean scores)"
        )
    return Attack(kind=args.attack, start_h=args.start_h, end_h=args.end_h, lamps=parse_lamps(args.targets),
                  magnitude=args.magnitude, seed=args.seed)  # fmt: skip


def run_detect(plan, attack: Attack, ctx=None) -> dict:
    """Fit the detectors on the plan's clean days, score ``attack`` on its test day:
    {"context", "scenario", "scores", "thresholds", "auc": {detector: AUC},
    "first_alarm_min": {detector: minutes, inf when none}}. ``ctx``: a context built for
    ``plan`` already (the tests pass one with a synthetic recorder)."""
    from tessera.apps.sil_fdia.detectors import DETECTORS, auc, delays_min, fit_detectors, scenario
    from tessera.apps.sil_fdia.experiment import build_context

    ctx = ctx or build_context(plan)
    check_lamps(ctx.dep, attack.lamps)
    per_day = ctx.dep.config.intervals_per_day
    fit_end = plan.train_days + plan.calib_days
    models = fit_detectors(ctx, slice(plan.train_days * per_day, fit_end * per_day), plan.false_alarm_rate)
    sc = scenario(ctx, attack, slice(fit_end * per_day, (fit_end + plan.test_days) * per_day))
    scores = models.score(sc["x"])
    out = {"context": ctx, "scenario": sc, "scores": scores, "thresholds": models.thresholds, "auc": {},
           "first_alarm_min": {}}  # fmt: skip
    for n in DETECTORS:
        delay = delays_min(sc, scores[n], models.thresholds[n], ctx.dep.config.interval_s)
        out["auc"][n] = auc([scores[n]], [sc["y"]])
        out["first_alarm_min"][n] = delay[0] if delay else float("nan")
    return out


def detect_command(args) -> str:
    """Fit the detectors on a small deployment's clean days and score the given attack on its test day."""
    if args.audio:
        return detect_audio(args.audio, args.plot)
    from tessera.apps.sil_fdia.plots import plot_telemetry

    attack = detect_attack(args)
    res = run_detect(detect_plan(args), attack)
    ctx = res["context"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tel, changed = apply_attack(ctx.dep, attack)
    plot_telemetry(
        ctx.dep,
        tel,
        changed,
        attack.lamps[0],
        out / "detect.png",
        res["scores"],
        (attack.start_h, attack.end_h),
    )
    parts = [
        f"{n} AUC {res['auc'][n]:.3f}, first alarm after {res['first_alarm_min'][n]:g} min"
        for n in res["auc"]
    ]
    return f"{attack.kind} on lamps {attack.lamps}: " + "; ".join(parts) + f"; wrote {out / 'detect.png'}"
