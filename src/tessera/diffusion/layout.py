"""ParallelConfig: how one sampling run is spread over ranks, checked before any work.

The mesh axes, outermost first: ``cfg`` (conditional / unconditional branch), then the
method axes ``pipefusion``, ``distrifusion``, ``tp``, ``ring``, ``ulysses`` (the last
varies fastest, so a Ulysses group is a block of neighbouring ranks, as in xDiT's USP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.runtime.mesh import Mesh

AXES = ("cfg", "pipefusion", "distrifusion", "tp", "ring", "ulysses")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    pipefusion_degree: int = 1
    num_patches: int | None = None  # PipeFusion patches along the height; default: the degree
    warmup_steps: int = 1  # PipeFusion / DistriFusion steps run synchronously on fresh K/V
    stage_layers: tuple[int, ...] | None = None  # layers per PipeFusion stage; default: even
    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_parallel: bool = False
    tp_degree: int = 1  # baseline: Megatron-style tensor parallel
    distrifusion_degree: int = 1  # baseline: DistriFusion patch parallel

    def __post_init__(self) -> None:
        for name in (
            "pipefusion_degree",
            "ulysses_degree",
            "ring_degree",
            "tp_degree",
            "distrifusion_degree",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.num_patches is not None and self.num_patches < self.pipefusion_degree:
            raise ValueError(
                f"num_patches {self.num_patches} is fewer than the {self.pipefusion_degree} pipeline "
                "stages; use at least one patch per stage"
            )
        if self.stage_layers is not None:
            if len(self.stage_layers) != self.pipefusion_degree or min(self.stage_layers) < 1:
                raise ValueError(
                    f"stage_layers {self.stage_layers} must give a positive layer count for each of "
                    f"the {self.pipefusion_degree} stages"
                )
        used = [n for n in ("pipefusion", "distrifusion", "tp") if self.degree(n) > 1]
        if self.sp_degree > 1 and self.pipefusion_degree == 1:
            used.append("ulysses/ring")
        if len(used) > 1:
            raise ValueError(
                f"{' and '.join(used)} cannot be combined; the baselines (distrifusion, tp) combine with "
                "cfg parallel only, PipeFusion with cfg, Ulysses and Ring"
            )

    def degree(self, axis: str) -> int:
        return 2 if axis == "cfg" and self.cfg_parallel else getattr(self, f"{axis}_degree", 1)

    @property
    def sp_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def patches(self) -> int:
        return self.num_patches or self.pipefusion_degree

    @property
    def world_size(self) -> int:
        return math.prod(self.degree(a) for a in AXES)

    @property
    def method(self) -> str:
        if self.patches > 1:  # PipeFusion's patch schedule also runs on a single stage
            return "pipefusion"
        for axis in ("distrifusion", "tp"):
            if self.degree(axis) > 1:
                return axis
        return "sequence" if self.sp_degree > 1 else "serial"

    def describe(self) -> str:
        parts = [f"{a}={self.degree(a)}" for a in AXES if self.degree(a) > 1]
        text = " x ".join(parts) or "serial"
        if self.method == "pipefusion":
            text += f" (patches={self.patches}, warmup_steps={self.warmup_steps})"
        elif self.method == "distrifusion":
            text += f" (warmup_steps={self.warmup_steps})"
        return text

    def build_mesh(self) -> Mesh:
        from tessera.runtime.mesh import Mesh, world_size

        world = world_size()
        if self.world_size != world:
            raise ValueError(
                f"parallel layout {self.describe()} needs {self.world_size} ranks but the world size "
                f"is {world}; choose degrees whose product is {world}"
            )
        return Mesh(**{a: self.degree(a) for a in AXES})


def split_rows(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of ``parts`` contiguous bands of ``total`` rows; the first
    ``total % parts`` bands get one row more."""
    if parts > total:
        raise ValueError(f"cannot split {total} token rows into {parts} bands; use at most {total}")
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def __getattr__(name: str):
    # ``stage_bounds`` (one split rule for training and inference) lives with the pipeline
    # code, which imports torch; it loads on first use so the command line's parsers need not.
    if name == "stage_bounds":
        from tessera.parallel.pipeline import stage_bounds

        return stage_bounds
    raise AttributeError(f"module 'tessera.diffusion.layout' has no attribute {name!r}")
