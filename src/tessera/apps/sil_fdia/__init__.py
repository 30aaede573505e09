"""False data injection on solar insecticidal lamps (issue 18): a simulated SIL-IoT field,
attacks on its telemetry, and detectors from telemetry and sound. See docs/fdia.md."""

from tessera.apps.sil_fdia.attacks import KINDS, Attack, apply_attack
from tessera.apps.sil_fdia.config import AudioConfig, LampConfig, SimConfig
from tessera.apps.sil_fdia.simulate import Deployment, simulate
from tessera.apps.sil_fdia.zaps import detect_zaps

__all__ = [
    "KINDS",
    "Attack",
    "AudioConfig",
    "Deployment",
    "LampConfig",
    "SimConfig",
    "apply_attack",
    "detect_zaps",
    "simulate",
]
