"""A SIL-IoT deployment, simulated: weather, insects, and each lamp's energy and grid.

Time 0 is noon of day 0, so every simulated day (noon to noon) holds one whole night.
Per lamp and interval the simulator keeps the truth (kills and their times, state of
charge) and the telemetry the lamp reports through the gateway: on/off, kill count, the
grid's mean and minimum voltage (each discharge dips the grid, which recharges with
``dip_recovery_s``), battery voltage and current, panel voltage and current, each read with
a sensor's noise. Everything is drawn from ``numpy`` generators seeded by
(seed, purpose, lamp), so one config gives one deployment.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.apps.sil_fdia.config import LampConfig, SimConfig

FIELDS = ("on", "kills", "grid_kv_mean", "grid_kv_min", "battery_v", "battery_a", "panel_v", "panel_a")
SENSOR_NOISE = {"grid_kv_mean": 0.003, "grid_kv_min": 0.01, "battery_v": 0.01, "battery_a": 0.02,
                "panel_v": 0.05, "panel_a": 0.01}  # fmt: skip
DIP_DEPTH = (0.3, 0.7)  # fraction of the grid voltage one discharge takes
DARK_W_M2 = 20.0  # the lamp's light sensor: on below this irradiance


@dataclass
class Deployment:
    config: SimConfig
    weather: dict[str, np.ndarray]  # per day: temperature_c, rain, wind, cloud (0..1); per interval: rain_now
    telemetry: dict[str, np.ndarray]  # FIELDS -> (lamps, intervals), as reported
    true_kills: np.ndarray  # (lamps, intervals)
    kill_times: list[list[np.ndarray]]  # [lamp][interval] -> seconds after the interval starts
    soc: np.ndarray  # (lamps, intervals), at each interval's end
    irradiance: np.ndarray  # (intervals,) W/m^2 shared by the lamps (they stand in one field)

    def clock_hours(self) -> np.ndarray:
        """Hour of the day at each interval's middle."""
        cfg = self.config
        return (12.0 + (np.arange(cfg.num_intervals) + 0.5) * cfg.interval_s / 3600.0) % 24.0

    def night_mask(self) -> np.ndarray:
        """Intervals between sunset and sunrise by the clock (what an independent sensor knows)."""
        hours = self.clock_hours()
        return (hours >= self.config.sunset_h) | (hours < self.config.sunrise_h)


def _rng(cfg: SimConfig, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([cfg.seed, *key]))


def _weather(cfg: SimConfig) -> dict[str, np.ndarray]:
    rng = _rng(cfg, 1)
    days = cfg.num_days
    rainy = rng.random(days) < 0.25
    weather = {
        "temperature_c": rng.normal(21.0, 3.0, days),
        "rain": np.where(rainy, rng.uniform(0.2, 1.0, days), 0.0),
        "wind": rng.beta(2.0, 5.0, days),
        "cloud": rng.beta(1.2, 2.5, days),
    }
    # rain falls in one spell of 1-6 hours somewhere in the night
    per_day = cfg.intervals_per_day
    rain_now = np.zeros(cfg.num_intervals)
    for day in np.flatnonzero(rainy):
        length = int(rng.uniform(1, 6) * 3600 / cfg.interval_s)
        start = day * per_day + int(
            rng.uniform(6.0, 17.0 - length * cfg.interval_s / 3600) * 3600 / cfg.interval_s
        )
        rain_now[start : start + length] = weather["rain"][day]
    weather["rain_now"] = rain_now
    return weather


def _irradiance(cfg: SimConfig, weather: dict[str, np.ndarray], hours: np.ndarray) -> np.ndarray:
    rng = _rng(cfg, 2)
    daylight = np.clip((hours - cfg.sunrise_h) / (cfg.sunset_h - cfg.sunrise_h), 0.0, 1.0)
    clear = 1000.0 * np.sin(np.pi * daylight) ** 1.3
    day = np.arange(hours.size) // cfg.intervals_per_day
    passing = np.clip(1.0 + 0.15 * rng.standard_normal(hours.size), 0.3, 1.3)  # passing clouds
    return clear * (1.0 - 0.75 * weather["cloud"][day]) * passing


def _insect_rate(cfg: SimConfig, weather: dict[str, np.ndarray], hours: np.ndarray, lamp: int) -> np.ndarray:
    """Expected kills per interval if the lamp were on all night: a Poisson mean."""
    rng = _rng(cfg, 3, lamp)
    site = rng.lognormal(0.0, 0.25)  # some lamps stand nearer hedges or water
    nightly = _rng(cfg, 4).lognormal(0.0, 0.3, cfg.num_days) * rng.lognormal(0.0, 0.1, cfg.num_days)
    activity = np.exp(0.12 * (weather["temperature_c"] - 21.0)) * np.exp(-1.5 * weather["wind"]) * nightly
    since_dusk = (hours - cfg.sunset_h) % 24.0
    night_len = (cfg.sunrise_h - cfg.sunset_h) % 24.0
    shape = np.where(since_dusk < night_len, (since_dusk + 0.2) ** 1.5 * np.exp(-since_dusk / 1.2), 0.0)
    per_interval = shape / (shape.sum() / cfg.num_days)  # each night's shape sums to 1
    day = np.arange(hours.size) // cfg.intervals_per_day
    rain_factor = 1.0 - 0.7 * weather["rain_now"]
    return cfg.insects_per_night * site * activity[day] * per_interval * rain_factor


def _run_lamp(cfg: SimConfig, lamp_cfg: LampConfig, irr: np.ndarray, rate: np.ndarray, lamp: int):
    """Step the battery, the lamp switch and the grid through every interval."""
    rng = _rng(cfg, 5, lamp)
    n, dt_h = cfg.num_intervals, cfg.interval_s / 3600.0
    energy = lamp_cfg.battery_wh * rng.uniform(0.6, 0.9)
    allowed = True
    out = {k: np.zeros(n) for k in ("on", "kills", "soc", "p_used", "curtailed", "i_bat", "v_bat")}
    for k in range(n):
        soc = energy / lamp_cfg.battery_wh
        allowed = soc > (lamp_cfg.reconnect_soc if not allowed else lamp_cfg.low_voltage_cutoff)
        on = irr[k] < DARK_W_M2 and allowed
        kills = rng.poisson(rate[k]) if on else 0
        load_w = lamp_cfg.controller_w + on * (lamp_cfg.lamp_w + lamp_cfg.grid_idle_w)
        load_w += kills * lamp_cfg.kill_joules / cfg.interval_s
        offered_w = lamp_cfg.panel_peak_w * irr[k] / 1000.0 * lamp_cfg.charge_efficiency
        room_w = (lamp_cfg.battery_wh - energy) / dt_h + load_w  # the controller curtails when full
        in_w = min(offered_w, room_w)
        new_energy = max(0.0, energy + (in_w - load_w) * dt_h)
        soc_end = new_energy / lamp_cfg.battery_wh
        v_ocv = 11.8 + 1.0 * soc_end
        i_bat = (new_energy - energy) / dt_h / v_ocv
        out["on"][k], out["kills"][k], out["soc"][k] = on, kills, soc_end
        out["p_used"][k], out["curtailed"][k] = in_w / lamp_cfg.charge_efficiency, offered_w > room_w + 1e-9
        out["i_bat"][k], out["v_bat"][k] = i_bat, v_ocv + i_bat * lamp_cfg.battery_r_ohm
        energy = new_energy
    return out


def _report(cfg: SimConfig, state: dict, irr: np.ndarray, lamp: int) -> dict[str, np.ndarray]:
    """What the lamp sends: the state read by its sensors (with their noise)."""
    rng = _rng(cfg, 6, lamp)
    lamp_cfg, n = cfg.lamp, cfg.num_intervals
    grid_kv = lamp_cfg.grid_kv * (1.0 + 0.02 * rng.standard_normal())  # each converter differs a little
    kills = state["kills"].astype(int)
    mean_kv, min_kv = np.zeros(n), np.zeros(n)
    for k in np.flatnonzero(state["on"]):
        depths = rng.uniform(*DIP_DEPTH, kills[k])
        mean_kv[k] = grid_kv * (1.0 - depths.sum() * lamp_cfg.dip_recovery_s / cfg.interval_s)
        min_kv[k] = grid_kv * (1.0 - depths.max()) if kills[k] else grid_kv
    panel_v = np.where(
        irr > 1.0,
        np.where(state["curtailed"] > 0, 21.5, 17.5) * (1 + 0.04 * np.log(np.maximum(irr, 1.0) / 1000.0)),
        0.0,
    )
    panel_v = np.maximum(panel_v, 0.0)
    panel_a = np.where(panel_v > 1.0, state["p_used"] / np.maximum(panel_v, 1.0), 0.0)
    values = {"grid_kv_mean": mean_kv, "grid_kv_min": min_kv, "battery_v": state["v_bat"],
              "battery_a": state["i_bat"], "panel_v": panel_v, "panel_a": panel_a}  # fmt: skip
    report = {"on": state["on"].astype(float), "kills": kills.astype(float)}
    for name, value in values.items():
        noisy = value + SENSOR_NOISE[name] * rng.standard_normal(n)
        if name.startswith("grid"):
            noisy = np.where(state["on"] > 0, noisy, 0.0)  # the grid is off with the lamp
        report[name] = np.maximum(noisy, 0.0) if name.startswith("panel") else noisy
    return report


def simulate(config: SimConfig) -> Deployment:
    weather = _weather(config)
    hours = (12.0 + (np.arange(config.num_intervals) + 0.5) * config.interval_s / 3600.0) % 24.0
    irr = _irradiance(config, weather, hours)
    reports, kills, socs, times = [], [], [], []
    for lamp in range(config.num_lamps):
        state = _run_lamp(config, config.lamp, irr, _insect_rate(config, weather, hours, lamp), lamp)
        reports.append(_report(config, state, irr, lamp))
        kills.append(state["kills"].astype(int))
        socs.append(state["soc"])
        rng = _rng(config, 7, lamp)
        times.append([np.sort(rng.uniform(0.0, config.interval_s, c)) for c in kills[-1]])
    telemetry = {f: np.stack([r[f] for r in reports]) for f in FIELDS}
    return Deployment(config, weather, telemetry, np.stack(kills), times, np.stack(socs), irr)
