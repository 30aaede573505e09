"""`tessera bench fdia`: false data injection on solar insecticidal lamps (issue 18).

Per attack kind, ROC-AUC and detection delay of the telemetry-only, sound-only and fused
detectors on held-out test days of one simulated deployment (the baseline here is the
telemetry-only detector, which is what a SIL-IoT platform has without microphones), the
share of clean test intervals above each alarm threshold, and the zap detector's F1 and
count error against SNR on fresh clips. Seeds: the deployment under test 1 (the detectors
were developed on seeds 0 and 3), the sound's calibration deployments 101-104.
"""

from __future__ import annotations

import math
import time

import numpy as np
from sklearn.metrics import roc_curve

from tessera.apps.sil_fdia.attacks import DEFAULTS
from tessera.apps.sil_fdia.detectors import DETECTORS
from tessera.apps.sil_fdia.experiment import ExperimentPlan, run_experiment, zap_sweep
from tessera.bench.harness import BenchResult

# a continuous recorder at night (600 s of every 10-min interval), 20 s by day when the lamp
# is off; audio is the main cost: 8 lamp-nights under test and 8 of calibration (4 seeds x 2)
FULL = ExperimentPlan(seed=1, sound_seeds=(101, 102, 103, 104), sound_lamps=1, sound_nights=2)
QUICK = ExperimentPlan(
    num_lamps=3, train_days=2, calib_days=1, test_days=1, listen_night_s=30.0, listen_day_s=10.0,
    scenarios_per_kind=2, targets=1, seed=1, workers=1, sound_seeds=(101, 102), sound_nights=1,
)  # fmt: skip
SWEEP_FULL = {"snrs": (0.0, 5.0, 10.0, 15.0, 20.0, 30.0), "clips": 24, "seconds": 60.0}
SWEEP_QUICK = {"snrs": (5.0, 10.0, 20.0), "clips": 4, "seconds": 20.0}


def _delay_stats(delays: list[float]) -> tuple[float, float]:
    finite = [d for d in delays if math.isfinite(d)]
    rate = len(finite) / len(delays) if delays else 0.0
    return rate, (float(np.median(finite)) if finite else float("nan"))


def _roc_points(results: dict) -> dict:
    out = {}
    for kind, res in results.items():
        ys = np.concatenate([s["y"][s["y"] >= 0] for s in res["runs"]])
        out[kind] = {}
        for name in DETECTORS:
            sc = np.concatenate(
                [score[name][s["y"] >= 0] for s, score in zip(res["runs"], res["scores"], strict=True)]
            )
            fpr, tpr, _ = roc_curve(ys, sc)
            keep = np.unique(np.linspace(0, fpr.size - 1, min(fpr.size, 120)).astype(int))
            out[kind][name] = {"fpr": fpr[keep].round(4).tolist(), "tpr": tpr[keep].round(4).tolist()}
    return out


def _rain_note(rain, intervals: int) -> str:
    if rain is None:
        return (
            f"rain: {intervals} rainy calibration intervals, too few for a model: no sound evidence in rain"
        )
    return (
        f"rain heard = {rain.gain:.3f} x reported + ({rain.false_per_s * 600:.2f} {rain.false_per_s_per_rejected * 600:+.3f} "
        f"x (r - {rain.ref_rejected:.1f})) false per 10 min at r rejected onsets/s (fitted on r = "
        f"{rain.rejected_range[0] + 1:.1f}-{rain.rejected_range[1] - 1:.1f}; none outside), variance {rain.var_a:.3g} + "
        f"{rain.var_b:.3g} e + {rain.var_c:.3g} e^2 ({rain.intervals} intervals)"
    )


def run_fdia_bench(
    *, quick: bool, progress: bool = True, plan: ExperimentPlan | None = None, sweep_plan: dict | None = None
) -> BenchResult:
    """``plan`` and ``sweep_plan`` (``zap_sweep``'s arguments) replace the quick or full
    sizes, e.g. a smaller run than ``--quick`` (the test suite's)."""
    plan = plan or (QUICK if quick else FULL)
    sweep_plan = sweep_plan or (SWEEP_QUICK if quick else SWEEP_FULL)
    began = time.perf_counter()
    exp = run_experiment(plan, progress=progress)
    detect_s = time.perf_counter() - began
    sweep = zap_sweep(**sweep_plan)
    rows = []
    for kind, res in exp["results"].items():
        row = {"attack": kind, "magnitude": DEFAULTS[kind] if DEFAULTS[kind] is not None else "-"}
        row["positives"] = int(sum((s["y"] == 1).sum() for s in res["runs"]))
        for name in DETECTORS:
            det = res["detectors"][name]
            rate, median = _delay_stats(det["delays_min"])
            row[f"auc_{name}"] = round(det["auc"], 4)
            row[f"detected_{name}"] = round(rate, 3)
            row[f"delay_{name}_min"] = median if math.isfinite(median) else None  # none detected
            row[f"false_alarms_{name}"] = round(det["false_alarm_rate"], 4)
        rows.append(row)
    by_kind = {r["attack"]: r for r in rows}
    by_snr = {r["snr_db"]: r for r in sweep}
    headline = {
        "fused_auc_scale_1_5x": by_kind["scale"]["auc_fused"],
        "fused_auc_replay": by_kind["replay"]["auc_fused"],
        "stealthy_auc_telemetry": by_kind["stealthy"]["auc_telemetry"],
        "stealthy_auc_fused": by_kind["stealthy"]["auc_fused"],
        "zap_f1_10db": round(by_snr[10.0]["f1"], 4) if 10.0 in by_snr else None,
    }
    clean_rows = [
        {"detector": n, "threshold": round(exp["thresholds"][n], 3),
         "clean_false_alarms": round(exp["clean_false_alarms"][n], 4), "target": plan.false_alarm_rate}
        for n in DETECTORS
    ]  # fmt: skip
    ctx = exp["context"]
    dry, rain = ctx.sound.dry, ctx.sound.rain
    thr = exp["thresholds"]
    notes = [
        f"{plan.num_lamps} lamps (seed {plan.seed}): {plan.train_days} clean days fit the telemetry's constants and isolation "
        f"forest, the next {plan.calib_days} clean days its clean score distribution and threshold, {plan.test_days} "
        f"held-out test days are attacked; {plan.scenarios_per_kind} scenarios per attack on {plan.targets} random lamp(s), "
        f"6 h each; audio at {plan.snr_db:g} dB SNR, {plan.listen_night_s:g} s recorded per 10-min interval at night and "
        f"{plan.listen_day_s:g} s by day. No detector sees an attack before the test days",
        f"sound calibration: {len(plan.sound_seeds)} other deployments (seeds {', '.join(map(str, plan.sound_seeds))}; "
        f"{plan.sound_lamps} lamp(s) x {plan.sound_nights} night(s) each), clean, every interval listened to. Count model "
        f"per weather class the recorder hears (rain: > 5 rejected onsets/s): dry heard = {dry.gain:.3f} x reported in "
        f"the recorded part + {dry.false_per_s * 600:.2f} false per 10 min, variance {dry.var_a:.3g} + {dry.var_b:.3g} e + "
        f"{dry.var_c:.3g} e^2 ({dry.intervals} intervals); " + _rain_note(rain, ctx.sound.rain_intervals),
        "score (every detector, unit = lamp x 10-min interval): the night's evidence so far, a CUSUM of per-interval "
        "log-likelihood ratios restarting at noon (telemetry: its largest residual tail as a p-value vs Beta(0.1,1), "
        "the grid relation +-1 sd; sound: heard-minus-reported z +-1 sd and x2 spread; a detector takes its largest "
        "stream); fused = telemetry + sound (independent evidence: log-likelihood ratios add). AUC per interval: "
        "attacked = a report the attack changed; clean = eligible reports outside any attack window and the 4 h after "
        "it (count attacks: intervals the lamp reports on; daytime: off; battery, replay: night)",
        f"thresholds at {plan.false_alarm_rate:.0%} of clean night intervals: telemetry {thr['telemetry']:.2f} (its "
        f"calibration days), sound {thr['sound']:.2f} (the calibration deployments' nights), fused {thr['fused']:.2f} "
        "(every pairing of the two). clean_false_alarms = share of the test days' night intervals above them "
        "with no attack anywhere; false_alarms per attack = share of that scenario's clean intervals above them, which "
        "also counts the untouched lamps beside the attacked ones (the telemetry's field-share check sees their share "
        "fall when an attacker inflates a neighbour's counts)",
        "delay: minutes from the first changed report to the first alarm on that lamp; detected = share of attacked "
        "lamps alarmed before the attack ends (missed ones are not in the median)",
        f"zap sweep: {sweep[0]['clips']} clips of {sweep_plan['seconds']:g} s per SNR, "
        "a quarter in rain; F1 with a 10 ms tolerance; count error = mean |detected - true| / true per clip",
        f"experiment {detect_s:.0f} s, total {time.perf_counter() - began:.0f} s",
    ]
    sweep_cols = ["snr_db", "clips", "zaps", "precision", "recall", "f1", "count_error", "f1_in_rain"]
    columns = ["attack", "magnitude", "positives"]
    columns += [f"auc_{n}" for n in DETECTORS] + [f"delay_{n}_min" for n in DETECTORS]
    columns += [f"detected_{n}" for n in DETECTORS] + [f"false_alarms_{n}" for n in DETECTORS]
    return BenchResult(
        name="fdia",
        headline=headline,
        rows=rows,
        columns=columns,
        notes=notes,
        extra={
            "zap_sweep": sweep,
            "roc": _roc_points(exp["results"]),
            "plan": plan.__dict__,
            "clean_false_alarms": clean_rows,
        },
        tables=[
            (
                "alarm thresholds on the clean test nights (no attack anywhere)",
                list(clean_rows[0]),
                clean_rows,
            ),
            ("zap detector against SNR", sweep_cols, sweep),
        ],  # fmt: skip
    )


def plot_fdia(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tessera.apps.sil_fdia.plots import COLORS

    roc = result.extra["roc"]
    fig, axes = plt.subplots(3, 4, figsize=(13, 9.5))
    flat = np.ravel(axes)
    for ax, row in zip(flat, result.rows, strict=False):
        for name in DETECTORS:
            pts = roc[row["attack"]][name]
            ax.plot(
                pts["fpr"], pts["tpr"], color=COLORS[name], lw=1.2, label=f"{name} {row[f'auc_{name}']:.2f}"
            )
        ax.plot([0, 1], [0, 1], color="0.7", lw=0.8, ls="--")
        ax.set_title(f"{row['attack']} (ROC)", fontsize=9)
        ax.legend(fontsize=6, loc="lower right")
        ax.tick_params(labelsize=7)
    sweep = result.extra["zap_sweep"]
    snr = [r["snr_db"] for r in sweep]
    ax = flat[8]
    for key, style in (("f1", "-o"), ("precision", "--"), ("recall", ":")):
        ax.plot(snr, [r[key] for r in sweep], style, label=key)
    ax.set_title("zap detector vs SNR", fontsize=9)
    ax.set_xlabel("SNR (dB)", fontsize=8)
    ax.legend(fontsize=7)
    ax = flat[9]
    ax.plot(snr, [r["count_error"] for r in sweep], "-o", color="tab:purple")
    ax.set_title("zap count error vs SNR", fontsize=9)
    ax.set_xlabel("SNR (dB)", fontsize=8)
    ax = flat[10]
    x = np.arange(len(result.rows))
    for i, name in enumerate(DETECTORS):
        ax.bar(
            x + (i - 1) * 0.27, [r[f"auc_{name}"] for r in result.rows], 0.27, color=COLORS[name], label=name
        )
    ax.set_xticks(x, [r["attack"] for r in result.rows], rotation=60, fontsize=7)
    ax.set_ylim(0.3, 1.0)
    ax.set_title("AUC per attack", fontsize=9)
    ax.legend(fontsize=6)
    flat[11].axis("off")
    fig.suptitle("SIL-IoT false data injection: detectors on held-out days")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
