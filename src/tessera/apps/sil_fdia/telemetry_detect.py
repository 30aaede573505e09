"""Detectors from telemetry alone: consistency with the lamp's physics, and a learned
anomaly score (scikit-learn's IsolationForest) fitted on clean days.

Physics (the operator knows the hardware, ``LampConfig``, and fits a few per-lamp constants
on clean days): kills only when on; on only in the dark; the grid's mean voltage falls by a
fixed amount per discharge and its minimum dips whenever there was one; the battery's state
of charge read from its voltage (OCV 11.8 V + 1 V x SoC, plus I x R) moves as the reported
current integrates; the battery current equals panel input minus the lamp's load; a lamp's share of all
the lamps' kills stays near its site's (the weather is common to the field).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.ensemble import IsolationForest

from tessera.apps.sil_fdia.simulate import Deployment

PHYSICS_NAMES = ("off_kills", "day_on", "grid_z", "grid_abs_z", "no_dip", "fake_dip", "energy_z1",
                 "energy_z6", "energy_z18", "curtailed_not_full", "load_z", "share_z")  # fmt: skip
FEATURE_NAMES = (*PHYSICS_NAMES, "isolation")


@dataclass
class Calibration:
    grid_v0: np.ndarray  # per lamp: mean grid kV with no kill
    grid_slope: np.ndarray  # per lamp: kV per kill
    grid_sd: np.ndarray  # with no kill: the sensor's noise
    grid_var_per_kill: (
        np.ndarray
    )  # kV^2 per kill: each dip's depth is random, so the mean's spread grows with kills
    kill_share: np.ndarray  # per lamp: its share of all lamps' kills (its site; the weather is shared)
    energy_sd: np.ndarray  # (3,) for windows 1, 6, 18
    load_sd: float
    share_var_c: float = (
        0.0  # the share's variance beyond a binomial's, x expected^2: each lamp's night differs a little
    )
    forest: IsolationForest | None = None


def _robust_sd(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(1.4826 * np.median(np.abs(x - np.median(x)))) + 1e-9 if x.size else 1.0


def _soc_from_voltage(dep: Deployment, tel: dict) -> np.ndarray:
    return tel["battery_v"] - 11.8 - tel["battery_a"] * dep.config.lamp.battery_r_ohm


def _energy_residual(dep: Deployment, tel: dict, window: int) -> np.ndarray:
    cfg = dep.config
    soc = _soc_from_voltage(dep, tel)
    flow = tel["battery_v"] * tel["battery_a"] * (cfg.interval_s / 3600.0) / cfg.lamp.battery_wh
    csum = np.cumsum(flow, axis=1)
    out = np.zeros_like(soc)
    out[:, window:] = soc[:, window:] - soc[:, :-window] - (csum[:, window:] - csum[:, :-window])
    return out


def _load_residual(dep: Deployment, tel: dict) -> np.ndarray:
    lamp, cfg = dep.config.lamp, dep.config
    load = (
        lamp.controller_w
        + tel["on"] * (lamp.lamp_w + lamp.grid_idle_w)
        + tel["kills"] * lamp.kill_joules / cfg.interval_s
    )
    inflow = tel["panel_v"] * tel["panel_a"] * lamp.charge_efficiency
    ocv = 11.8 + np.clip(_soc_from_voltage(dep, tel), 0.0, 1.0)
    return tel["battery_a"] - (inflow - load) / ocv


def fit_calibration(dep: Deployment, tel: dict, days: slice) -> Calibration:
    """Per-lamp constants from clean ``days`` of telemetry (``tel``)."""
    per_day = dep.config.intervals_per_day
    span = slice(days.start * per_day, days.stop * per_day)
    lamps = tel["kills"].shape[0]
    v0, slope, sd, per_kill = (np.zeros(lamps) for _ in range(4))
    for lamp in range(lamps):
        on = tel["on"][lamp, span] > 0
        x, y = tel["kills"][lamp, span][on], tel["grid_kv_mean"][lamp, span][on]
        slope[lamp], v0[lamp] = np.polyfit(x, y, 1)
        resid = y - (v0[lamp] + slope[lamp] * x)
        (var0, var1), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), resid**2, rcond=None)
        sd[lamp] = np.sqrt(max(var0, _robust_sd(resid[x == 0]) ** 2 if (x == 0).sum() > 10 else var0, 1e-8))
        per_kill[lamp] = max(var1, 0.0)
    share = tel["kills"][:, span].sum(axis=1) / max(tel["kills"][:, span].sum(), 1.0)
    energy_sd = np.array([_robust_sd(_energy_residual(dep, tel, w)[:, span][:, 18:]) for w in (1, 6, 18)])
    calib = Calibration(
        v0, slope, sd, per_kill, share, energy_sd, _robust_sd(_load_residual(dep, tel)[:, span])
    )
    expected, binomial = share_expected(tel, calib)
    on = tel["on"][:, span] > 0
    excess = ((tel["kills"] - expected) ** 2 - binomial)[:, span][on]
    calib.share_var_c = float(max(excess.sum() / max((expected[:, span][on] ** 2).sum(), 1e-9), 0.0))
    feats = physics_features(dep, tel, calib)[:, span].reshape(-1, len(PHYSICS_NAMES))
    calib.forest = IsolationForest(n_estimators=200, random_state=0).fit(_forest_input(dep, tel, feats, span))
    return calib


def _forest_input(dep: Deployment, tel: dict, physics: np.ndarray, span: slice) -> np.ndarray:
    hours = np.broadcast_to(dep.clock_hours()[span], tel["kills"][:, span].shape).reshape(-1)
    raw = [tel[k][:, span].reshape(-1) for k in ("on", "battery_v", "battery_a", "panel_v", "panel_a")]
    angle = 2 * np.pi * hours / 24.0
    return np.column_stack(
        [physics, np.log1p(tel["kills"][:, span].reshape(-1)), *raw, np.sin(angle), np.cos(angle)]
    )


def share_expected(tel: dict, calib: Calibration) -> tuple[np.ndarray, np.ndarray]:
    """The lamp's kills its site's share of the field's implies, and their binomial variance (+1)."""
    share = calib.kill_share[:, None]
    expected = share * tel["kills"].sum(axis=0, keepdims=True)
    return expected, expected * (1.0 - share) + 1.0


def physics_features(dep: Deployment, tel: dict, calib: Calibration) -> np.ndarray:
    """(lamps, intervals, len(PHYSICS_NAMES)) residuals, each near 0 on clean telemetry."""
    on, kills = tel["on"] > 0, tel["kills"]
    v0, slope = calib.grid_v0[:, None], calib.grid_slope[:, None]
    grid_spread = np.sqrt(calib.grid_sd[:, None] ** 2 + calib.grid_var_per_kill[:, None] * kills)
    grid_z = np.where(on, (tel["grid_kv_mean"] - (v0 + slope * kills)) / grid_spread, 0.0)
    dipped = tel["grid_kv_min"] < 0.9 * v0
    # the night's weather moves every lamp's count together; a lamp's share of the total does not
    expected, binomial = share_expected(tel, calib)
    energy = [np.abs(_energy_residual(dep, tel, w)) / calib.energy_sd[i] for i, w in enumerate((1, 6, 18))]
    soc = _soc_from_voltage(dep, tel)
    feats = [
        np.log1p(kills * ~on),
        (on & (tel["panel_v"] > 16.5)).astype(float),
        grid_z,
        np.abs(grid_z),
        (on & (kills > 0) & ~dipped).astype(float),
        (on & (kills == 0) & dipped).astype(float),
        *energy,
        (tel["panel_v"] > 20.0) * np.clip(0.97 - soc, 0.0, None) / calib.energy_sd[0],
        np.abs(_load_residual(dep, tel)) / calib.load_sd,
        (kills - expected) / np.sqrt(binomial + calib.share_var_c * expected**2),
    ]
    return np.stack(feats, axis=-1)


def telemetry_features(dep: Deployment, tel: dict, calib: Calibration) -> np.ndarray:
    """(lamps, intervals, len(FEATURE_NAMES)): the physics residuals and the forest's anomaly score."""
    physics = physics_features(dep, tel, calib)
    span = slice(0, tel["kills"].shape[1])
    flat = _forest_input(dep, tel, physics.reshape(-1, physics.shape[-1]), span)
    isolation = -calib.forest.score_samples(flat).reshape(tel["kills"].shape)
    return np.concatenate([physics, isolation[..., None]], axis=-1)
