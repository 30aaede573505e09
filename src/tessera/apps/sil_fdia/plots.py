"""Pictures: telemetry with the injected spans shaded, a spectrogram with the zaps the
detector found marked (the ROC curves per attack type are drawn by `tessera.bench.fdia`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

COLORS = {"telemetry": "tab:blue", "sound": "tab:green", "fused": "tab:red"}


def _shade(ax, changed: np.ndarray, hours: np.ndarray, window=None) -> None:
    if window is not None:
        ax.axvspan(*window, color="tab:red", alpha=0.07, lw=0)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], changed.astype(int), [0]])))
    step = hours[1] - hours[0] if hours.size > 1 else 1.0
    for start, stop in zip(edges[::2], edges[1::2], strict=True):
        ax.axvspan(hours[start], hours[stop - 1] + step, color="tab:red", alpha=0.18, lw=0)


def plot_telemetry(
    dep, tel: dict, changed: np.ndarray, lamp: int, path: str | Path, scores: dict | None = None, window=None
) -> None:
    """One lamp's reports over the simulation; red spans: reports the attack changed (pale: its window)."""
    hours = np.arange(tel["kills"].shape[1]) * dep.config.interval_s / 3600.0
    panels = [
        ("kills", "kills / interval"),
        ("grid_kv_mean", "grid mean kV"),
        ("battery_v", "battery V"),
        ("panel_v", "panel V"),
    ]
    rows = len(panels) + (scores is not None)
    fig, axes = plt.subplots(rows, 1, figsize=(11, 1.9 * rows), sharex=True)
    for ax, (key, label) in zip(axes, panels, strict=False):
        if key == "kills":
            ax.plot(hours, dep.true_kills[lamp], color="0.6", lw=1, label="true")
        ax.plot(hours, tel[key][lamp], color="k", lw=1, label="reported")
        if key == "grid_kv_mean":
            on = tel["on"][lamp] > 0
            ax.set_ylim(
                np.percentile(tel[key][lamp][on], 1) - 0.02, np.max(tel[key][lamp]) + 0.01
            ) if on.any() else None
        ax.set_ylabel(label, fontsize=8)
        _shade(ax, changed[lamp], hours, window)
    axes[0].legend(fontsize=7, loc="upper right")
    if scores is not None:
        ax = axes[-1]
        for name, values in scores.items():
            ax.plot(hours, values[lamp], color=COLORS.get(name), lw=1, label=name)
        ax.set_ylabel("detector score", fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
        _shade(ax, changed[lamp], hours, window)
    axes[-1].set_xlabel("hours after noon of day 0")
    axes[0].set_title(f"lamp {lamp}: telemetry as received (red: injected)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_spectrogram(
    audio: np.ndarray, sample_rate: int, detected_s: np.ndarray, path: str | Path, true_s=None, title=""
):
    """Spectrogram with detected zaps as red ticks above it (true ones, if known, as white ticks below)."""
    fig, ax = plt.subplots(figsize=(11, 3.6))
    ax.specgram(audio, NFFT=256, Fs=sample_rate, noverlap=128, cmap="magma", scale="dB")
    top = sample_rate / 2
    ax.plot(
        detected_s,
        np.full(len(detected_s), top * 0.97),
        "v",
        color="tab:red",
        ms=6,
        label=f"detected ({len(detected_s)})",
    )
    if true_s is not None:
        ax.plot(
            true_s, np.full(len(true_s), top * 0.03), "^", color="white", ms=5, label=f"true ({len(true_s)})"
        )
    ax.set_ylim(0, top)
    ax.set_xlabel("seconds")
    ax.set_ylabel("Hz")
    ax.set_title(title or "zaps in the audio")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
