"""Device profiles: peak dense throughput and memory of common accelerators, from the
vendors' datasheets (dense figures; the datasheets' larger "with sparsity" numbers are
halved). Used to scale emulated links to the balance a GPU would see, and by cost models.

    name       fp32 TFLOP/s   bf16 TFLOP/s (tensor, dense)   memory GB/s   memory GiB   source
    l40        90.5           181                            864           48           NVIDIA L40 datasheet
    l20        59.8           119.5                          864           48           NVIDIA L20 datasheet
    a100       19.5           312                            2039          80           NVIDIA A100 datasheet (SXM 80GB)
    h100       67             989                            3350          80           NVIDIA H100 datasheet (SXM)
    h200       67             989                            4800          141          NVIDIA H200 datasheet (SXM)
    rtx4090    82.6           165.2                          1008          24           NVIDIA Ada GPU architecture whitepaper
    h20        44             148                            4000          96           NVIDIA H20 specifications (no public
                                                                                         datasheet; the figures resellers list)
    v100       15.7           125 (fp16: no bf16)            900           32           NVIDIA V100 datasheet (SXM2 32GB)
    a100-40gb  19.5           312                            1555          40           NVIDIA A100 datasheet (SXM 40GB)

Beside the datasheets, profiles measured on a machine: ``benchmarks/gpu/calibrate_device.py``
(on a GPU) and ``tessera.bench.plan.measure_cpu`` (here) write ``NAME.json`` files into a
profile folder, ``$TESSERA_PROFILE_DIR`` or ``~/.cache/tessera/devices``, which
``device_named`` looks in first (a measured profile of a datasheet name replaces it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

TERA, GB, GIB = 1e12, 1e9, 2**30


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    name: str
    fp32_flops: float
    bf16_flops: float
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    source: str


DEVICES: dict[str, DeviceProfile] = {
    d.name: d
    for d in (
        DeviceProfile(
            name="l40",
            fp32_flops=90.5 * TERA,
            bf16_flops=181 * TERA,
            memory_bandwidth=864 * GB,
            memory_bytes=48 * GIB,
            source="NVIDIA L40 datasheet",
        ),
        DeviceProfile(
            name="l20",
            fp32_flops=59.8 * TERA,
            bf16_flops=119.5 * TERA,
            memory_bandwidth=864 * GB,
            memory_bytes=48 * GIB,
            source="NVIDIA L20 datasheet",
        ),
        DeviceProfile(
            name="a100",
            fp32_flops=19.5 * TERA,
            bf16_flops=312 * TERA,
            memory_bandwidth=2039 * GB,
            memory_bytes=80 * GIB,
            source="NVIDIA A100 datasheet (SXM 80GB)",
        ),
        DeviceProfile(
            name="h100",
            fp32_flops=67 * TERA,
            bf16_flops=989 * TERA,
            memory_bandwidth=3350 * GB,
            memory_bytes=80 * GIB,
            source="NVIDIA H100 datasheet (SXM)",
        ),
        DeviceProfile(
            name="h200",
            fp32_flops=67 * TERA,
            bf16_flops=989 * TERA,
            memory_bandwidth=4800 * GB,
            memory_bytes=141 * GIB,
            source="NVIDIA H200 datasheet (SXM)",
        ),
        DeviceProfile(
            name="h20",
            fp32_flops=44 * TERA,
            bf16_flops=148 * TERA,
            memory_bandwidth=4000 * GB,
            memory_bytes=96 * GIB,
            source="NVIDIA H20 specifications as resellers list them (no public NVIDIA datasheet)",
        ),
        DeviceProfile(
            name="v100",
            fp32_flops=15.7 * TERA,
            bf16_flops=125 * TERA,  # fp16 tensor cores: V100 has no bf16
            memory_bandwidth=900 * GB,
            memory_bytes=32 * GIB,
            source="NVIDIA V100 datasheet (SXM2 32GB)",
        ),
        DeviceProfile(
            name="a100-40gb",
            fp32_flops=19.5 * TERA,
            bf16_flops=312 * TERA,
            memory_bandwidth=1555 * GB,
            memory_bytes=40 * GIB,
            source="NVIDIA A100 datasheet (SXM 40GB)",
        ),
        DeviceProfile(
            name="rtx4090",
            fp32_flops=82.6 * TERA,
            bf16_flops=165.2 * TERA,
            memory_bandwidth=1008 * GB,
            memory_bytes=24 * GIB,
            source="NVIDIA Ada GPU architecture whitepaper",
        ),
    )
}


def profile_dir() -> Path:
    return Path(os.environ.get("TESSERA_PROFILE_DIR", Path.home() / ".cache" / "tessera" / "devices"))


def save_profile(profile: DeviceProfile, folder: str | Path | None = None) -> Path:
    """Write ``profile`` as NAME.json (atomically: a crash leaves the old file whole)."""
    folder = Path(folder) if folder else profile_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{profile.name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(profile), indent=1))
    tmp.replace(path)
    return path


def load_profile(path: str | Path) -> DeviceProfile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        return DeviceProfile(**{f.name: data[f.name] for f in dataclasses.fields(DeviceProfile)})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path}: not a device profile ({exc}); rerun the calibration that wrote it"
        ) from None


def measured_profiles() -> dict[str, DeviceProfile]:
    folder = profile_dir()
    return {p.stem: load_profile(p) for p in sorted(folder.glob("*.json"))} if folder.is_dir() else {}


def device_named(name: str) -> DeviceProfile:
    """A measured profile (see module doc) or a datasheet one; a path to a profile JSON too."""
    measured = measured_profiles()
    if name in measured:
        return measured[name]
    if name in DEVICES:
        return DEVICES[name]
    if name.endswith(".json") and Path(name).is_file():
        return load_profile(name)
    known = ", ".join([*DEVICES, *measured])
    raise ValueError(f"unknown device profile {name!r}; choose one of {known} or give a profile .json")
