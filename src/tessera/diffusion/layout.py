"""ParallelConfig: how one sampling run is spread over ranks, checked before any work.

The mesh axes, outermost first: ``cfg`` (conditional / unconditional branch), then the
method axes ``pipefusion``, ``distrifusion``, ``tp``, ``ring``, ``ulysses`` (the last
varies fastest, so a Ulysses group is a block of neighbouring ranks, as in xDiT's USP).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.runtime.mesh import Mesh

AXES = ("cfg", "pipefusion", "distrifusion", "tp", "ring", "ulysses")


# The names before issue 29's one naming scheme (docs/conventions.md, "Names"): accepted as
# keywords and read as attributes for one release, with a FutureWarning, then removed.
_OLD_NAMES = {
    "pipefusion_degree": "pipefusion",
    "ulysses_degree": "ulysses",
    "ring_degree": "ring",
    "tp_degree": "tp",
    "distrifusion_degree": "distrifusion",
    "num_patches": "patches",
    "sp_degree": "sp",
}


def _renamed(old: str) -> None:
    warnings.warn(
        f"ParallelConfig.{old} is renamed {_OLD_NAMES[old]}; the old name goes in the next release",
        FutureWarning,
        stacklevel=3,
    )


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """A degree per mesh axis, named by the axis (``pipefusion``, ``ulysses``, ``ring``,
    ``tp``, ``distrifusion``; ``cfg_parallel`` puts the two guidance branches on two ranks),
    as ``Plan`` names its ``dp``/``tp``/``pp``/``sp``. ``patches``: PipeFusion patches along the
    height (None: the PipeFusion degree, resolved when the config is made)."""

    pipefusion: int = 1
    patches: int | None = None
    warmup_steps: int = 1  # PipeFusion / DistriFusion steps run synchronously on fresh K/V
    stage_layers: tuple[int, ...] | None = None  # layers per PipeFusion stage; default: even
    ulysses: int = 1
    ring: int = 1
    cfg_parallel: bool = False
    tp: int = 1  # baseline: Megatron-style tensor parallel
    distrifusion: int = 1  # baseline: DistriFusion patch parallel

    def __post_init__(self) -> None:
        for name in ("pipefusion", "ulysses", "ring", "tp", "distrifusion"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.patches is None:  # one spelling: the field holds the count used
            object.__setattr__(self, "patches", self.pipefusion)
        if not isinstance(self.patches, int) or self.patches < self.pipefusion:
            raise ValueError(
                f"patches {self.patches} is fewer than the {self.pipefusion} pipeline "
                "stages; use at least one patch per stage"
            )
        if self.stage_layers is not None:
            if len(self.stage_layers) != self.pipefusion or min(self.stage_layers) < 1:
                raise ValueError(
                    f"stage_layers {self.stage_layers} must give a positive layer count for each of "
                    f"the {self.pipefusion} stages"
                )
        used = [n for n in ("pipefusion", "distrifusion", "tp") if self.degree(n) > 1]
        if self.sp > 1 and self.pipefusion == 1:
            used.append("ulysses/ring")
        if len(used) > 1:
            raise ValueError(
                f"{' and '.join(used)} cannot be combined; the baselines (distrifusion, tp) combine with "
                "cfg parallel only, PipeFusion with cfg, Ulysses and Ring"
            )

    def degree(self, axis: str) -> int:
        if axis == "cfg":
            return 2 if self.cfg_parallel else 1
        return getattr(self, axis) if axis in AXES else 1

    @property
    def sp(self) -> int:
        """The sequence parallel degree: Ulysses x Ring."""
        return self.ulysses * self.ring

    def __getattr__(self, name: str):  # only reached for names the class does not have
        if name in _OLD_NAMES:
            _renamed(name)
            return getattr(self, _OLD_NAMES[name])
        raise AttributeError(f"'ParallelConfig' object has no attribute {name!r}")

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
        return "sequence" if self.sp > 1 else "serial"

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


_init = ParallelConfig.__init__


@functools.wraps(_init)  # the signature shown is the fields'
def _init_accepting_old_names(self, **kwargs) -> None:
    for old, new in _OLD_NAMES.items():
        if old in kwargs:
            _renamed(old)
            if new in kwargs:
                raise TypeError(f"ParallelConfig got both {old}= and {new}=; give {new}= only")
            kwargs[new] = kwargs.pop(old)
    _init(self, **kwargs)


ParallelConfig.__init__ = _init_accepting_old_names


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
