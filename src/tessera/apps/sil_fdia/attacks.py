"""False data injection on the telemetry path (a compromised gateway or link): the lamps
and the sound are untouched, only what the lamp reports is changed, from ``start_h`` to
``end_h`` (hours after the simulation starts, at noon of day 0) on the ``lamps`` listed.

Kinds: ``scale`` (kills x ``factor``), ``additive`` (kills + ``offset``), ``replay`` (every
field copied from ``source_days`` earlier), ``constant`` (kills = ``value``, default the
lamp's mean from before the attack), ``zero`` (kills = 0), ``daytime`` (Poisson(``value``)
kills reported while the lamp is off), ``battery`` (battery voltage held at ``value`` volts,
a healthy 12.7 V by default, hiding a drain), and ``stealthy``: kills drawn afresh from the
lamp's own per-slot means learned from the reports before the attack (the counts keep
their statistics), with the grid's mean voltage and dips forged to agree with them using
the relation the attacker fitted on the same history. Count attacks change only intervals
in which the lamp reports itself on (``daytime``: off).

One attacker also forges the sound: ``replay_audio`` switches the target lamp's grid off
(it kills nothing: sabotage), forwards every field from ``source_days`` earlier as
``replay`` does, and plays the zaps recorded at the lamp those days earlier, at the same
clock time, from a loudspeaker beside it; the microphone hears those zaps over tonight's
background and none of tonight's (``forged_zaps``). The loudspeaker is taken as perfect
(the zaps themselves, without the recording's own background or a speaker's colouring):
the attacker's best case.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.apps.sil_fdia.simulate import Deployment

KINDS = ("scale", "additive", "replay", "constant", "zero", "daytime", "battery", "stealthy", "replay_audio")
AUDIO_KINDS = ("replay_audio",)  # the attacks that also change what the microphone hears
DEFAULTS = {"scale": 1.5, "additive": 5.0, "replay": 1.0, "constant": None, "zero": None, "daytime": 5.0,
            "battery": 12.7, "stealthy": None, "replay_audio": 1.0}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Attack:
    kind: str
    start_h: float
    end_h: float
    lamps: tuple[int, ...]
    magnitude: float | None = None  # factor, offset, source_days or value; None: DEFAULTS[kind]
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown attack {self.kind!r}; known: {', '.join(KINDS)}")
        if not self.end_h > self.start_h:
            raise ValueError(
                f"attack window must end after it starts, got {self.start_h} h to {self.end_h} h"
            )
        if not self.lamps:
            raise ValueError("an attack needs at least one target lamp")

    @property
    def value(self) -> float | None:
        return DEFAULTS[self.kind] if self.magnitude is None else self.magnitude


def _window(dep: Deployment, attack: Attack) -> slice:
    cfg = dep.config
    hours = cfg.num_days * 24.0
    if attack.start_h < 0 or attack.end_h > hours:
        raise ValueError(
            f"attack window {attack.start_h} h to {attack.end_h} h is outside the simulated period 0 h to {hours:g} h"
        )
    step = cfg.interval_s / 3600.0
    return slice(int(np.floor(attack.start_h / step)), int(np.ceil(attack.end_h / step)))


def check_lamps(dep: Deployment, lamps) -> None:
    for lamp in lamps:
        if not (isinstance(lamp, int | np.integer) and 0 <= lamp < dep.config.num_lamps):
            raise ValueError(
                f"unknown lamp id {lamp!r}; this deployment has lamps 0..{dep.config.num_lamps - 1}"
            )


def apply_attack(dep: Deployment, attack: Attack) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The telemetry as received under ``attack``, and the (lamps, intervals) mask of reports it changed."""
    check_lamps(dep, attack.lamps)
    window = _window(dep, attack)
    clean = dep.telemetry
    out = {k: v.copy() for k, v in clean.items()}
    rng = np.random.default_rng(np.random.SeedSequence([attack.seed, KINDS.index(attack.kind), 77]))
    for lamp in attack.lamps:
        _ATTACKERS[attack.kind](dep, out, lamp, window, attack, rng)
    changed = np.zeros(clean["kills"].shape, dtype=bool)
    for key in clean:
        changed |= ~np.isclose(out[key], clean[key], rtol=0, atol=1e-12)
    return out, changed


def _on(tel, lamp, window) -> np.ndarray:
    return np.flatnonzero(tel["on"][lamp, window] > 0) + window.start


def _history_mean(tel, lamp, window) -> float:
    on = tel["on"][lamp, : window.start] > 0
    return float(tel["kills"][lamp, : window.start][on].mean()) if on.any() else 5.0


def _scale(dep, tel, lamp, window, attack, rng):
    idx = _on(tel, lamp, window)
    tel["kills"][lamp, idx] = np.rint(tel["kills"][lamp, idx] * attack.value)


def _additive(dep, tel, lamp, window, attack, rng):
    idx = _on(tel, lamp, window)
    tel["kills"][lamp, idx] = np.maximum(0.0, tel["kills"][lamp, idx] + np.rint(attack.value))


def _shift(dep: Deployment, attack: Attack, window: slice) -> int:
    shift = int(round(attack.value * dep.config.intervals_per_day))
    if not 0 < shift <= window.start:
        raise ValueError(
            f"replay of {attack.value:g} day(s) earlier needs the attack to start at least that long after 0 h "
            f"(it starts at {attack.start_h} h)"
        )
    return shift


def forged_zaps(dep: Deployment, attack: Attack) -> dict[tuple[int, int], np.ndarray]:
    """(lamp, interval) -> the zap times (s into the interval) the microphone hears instead of
    the lamp's own, for every interval of the window on every target; empty for an attack
    that leaves the sound alone. ``replay_audio``: the lamp's own zaps of ``source_days``
    earlier in the same slot (its grid is off: tonight it kills nothing)."""
    if attack.kind not in AUDIO_KINDS:
        return {}
    check_lamps(dep, attack.lamps)
    window = _window(dep, attack)
    shift = _shift(dep, attack, window)
    return {(lamp, k): dep.kill_times[lamp][k - shift].copy()
            for lamp in attack.lamps for k in range(window.start, window.stop)}  # fmt: skip


def _replay(dep, tel, lamp, window, attack, rng):
    shift = _shift(dep, attack, window)
    for key in tel:
        tel[key][lamp, window] = dep.telemetry[key][lamp, window.start - shift : window.stop - shift]


def _constant(dep, tel, lamp, window, attack, rng):
    value = attack.value if attack.value is not None else max(1.0, round(_history_mean(tel, lamp, window)))
    tel["kills"][lamp, _on(tel, lamp, window)] = value


def _zero(dep, tel, lamp, window, attack, rng):
    tel["kills"][lamp, _on(tel, lamp, window)] = 0.0


def _daytime(dep, tel, lamp, window, attack, rng):
    idx = np.flatnonzero(tel["on"][lamp, window] == 0) + window.start
    tel["kills"][lamp, idx] = rng.poisson(attack.value, idx.size)


def _battery(dep, tel, lamp, window, attack, rng):
    size = window.stop - window.start
    tel["battery_v"][lamp, window] = attack.value + 0.01 * rng.standard_normal(size)


def _stealthy(dep, tel, lamp, window, attack, rng):
    per_day = dep.config.intervals_per_day
    past = slice(0, window.start - window.start % per_day)  # whole days seen before the attack
    if past.stop < per_day:
        raise ValueError(
            f"the stealthy attack learns from whole days before it: start it after 24 h, not {attack.start_h} h"
        )
    kills_hist = tel["kills"][lamp, past].reshape(-1, per_day)
    slot_mean = kills_hist.mean(axis=0)
    on_hist = tel["on"][lamp, past] > 0
    x, y = tel["kills"][lamp, past][on_hist], tel["grid_kv_mean"][lamp, past][on_hist]
    slope = np.polyfit(x, y, 1)[0] if np.ptp(x) > 0 else 0.0
    dipped = tel["grid_kv_min"][lamp, past][on_hist & (tel["kills"][lamp, past] > 0)]
    idx = _on(tel, lamp, window)
    real = tel["kills"][lamp, idx]
    forged = rng.poisson(slot_mean[idx % per_day]).astype(float)
    tel["kills"][lamp, idx] = forged
    tel["grid_kv_mean"][lamp, idx] += slope * (forged - real)
    mins = tel["grid_kv_min"][lamp, idx]
    undipped = tel["grid_kv_mean"][lamp, idx] + 0.01 * rng.standard_normal(idx.size)
    fake_dip = rng.choice(dipped, idx.size) if dipped.size else mins
    tel["grid_kv_min"][lamp, idx] = np.where(forged == 0, undipped, np.where(real == 0, fake_dip, mins))


_ATTACKERS = {"scale": _scale, "additive": _additive, "replay": _replay, "constant": _constant, "zero": _zero,
              "daytime": _daytime, "battery": _battery, "stealthy": _stealthy,
              "replay_audio": _replay}  # fmt: skip
