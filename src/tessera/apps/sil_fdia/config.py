"""Typed, keyword-only configurations of a simulated SIL-IoT deployment and of its audio.

Every number here is a modelling choice; docs/fdia.md says where each comes from and
which way it moves the detectors.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{owner}.{name} must be > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LampConfig:
    """One lamp's hardware: a 12 V lead-acid battery, a small panel, a UV lamp and a HV grid."""

    panel_peak_w: float = 40.0  # at 1000 W/m^2
    battery_wh: float = 240.0  # usable energy between 11.8 V (empty) and 12.8 V (full)
    battery_r_ohm: float = 0.05  # internal resistance: terminal V = OCV + I R (I > 0 charging)
    charge_efficiency: float = 0.92
    lamp_w: float = 8.0  # UV LED tube
    grid_idle_w: float = 1.5  # HV converter keeping the grid charged
    controller_w: float = 0.3  # controller + radio, always on
    kill_joules: float = 1.0  # one discharge through an insect
    grid_kv: float = 3.5  # grid voltage with no discharge
    dip_recovery_s: float = 0.5  # the grid capacitor's recharge time constant after a dip
    low_voltage_cutoff: float = 0.10  # state of charge at which the lamp is switched off
    reconnect_soc: float = 0.25  # ... and at which it may come back on

    def __post_init__(self) -> None:
        _check_positive(
            "LampConfig", panel_peak_w=self.panel_peak_w, battery_wh=self.battery_wh,
            lamp_w=self.lamp_w, grid_kv=self.grid_kv, dip_recovery_s=self.dip_recovery_s,
        )  # fmt: skip
        if not 0 <= self.low_voltage_cutoff < self.reconnect_soc < 1:
            raise ValueError(
                f"LampConfig needs 0 <= low_voltage_cutoff < reconnect_soc < 1, got "
                f"{self.low_voltage_cutoff} and {self.reconnect_soc}"
            )


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """A deployment: lamps, days, the reporting interval and the insects' nightly activity."""

    num_lamps: int = 4
    num_days: int = 7
    interval_s: int = 600  # one telemetry report every 10 minutes
    seed: int = 0
    sunrise_h: float = 5.5  # a summer night: lamps on for about 9 hours
    sunset_h: float = 19.5
    insects_per_night: float = 400.0  # mean kills of a lamp on a warm, dry, calm night
    lamp: LampConfig = LampConfig()

    def __post_init__(self) -> None:
        for name in ("num_lamps", "num_days", "interval_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SimConfig.{name} must be a positive integer, got {value!r}")
        if 86400 % self.interval_s:
            raise ValueError(f"SimConfig.interval_s must divide a day (86400 s), got {self.interval_s}")
        if not 0 < self.sunrise_h < self.sunset_h < 24:
            raise ValueError(
                f"SimConfig needs 0 < sunrise_h < sunset_h < 24, got {self.sunrise_h} and {self.sunset_h}"
            )
        _check_positive("SimConfig", insects_per_night=self.insects_per_night)

    @property
    def intervals_per_day(self) -> int:
        return 86400 // self.interval_s

    @property
    def num_intervals(self) -> int:
        return self.num_days * self.intervals_per_day


@dataclass(frozen=True, kw_only=True)
class AudioConfig:
    """The microphone beside each lamp and the sound around it."""

    sample_rate: int = 16000
    snr_db: float = 20.0  # a median zap's power over its 5 ms against the background's
    listen_s: float | None = None  # seconds recorded per interval (None: the whole interval)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sample_rate < 8000:
            raise ValueError(f"AudioConfig.sample_rate must be >= 8000 Hz, got {self.sample_rate}")
        if self.listen_s is not None and not self.listen_s > 0:
            raise ValueError(f"AudioConfig.listen_s must be > 0 or None, got {self.listen_s!r}")
