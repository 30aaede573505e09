"""``Plan``: how one training job is spread over processes, as one validated value."""

from __future__ import annotations

from dataclasses import asdict, dataclass

PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Data parallel degree ``dp`` and tensor parallel degree ``tp`` (``dp * tp`` = world
    size); ``zero`` 0-3 (what data-parallel ranks shard: 1 optimizer states, 2 also
    gradients, 3 also parameters); ``precision`` "fp32" or "bf16" (bf16 autocast, fp32 master
    weights and optimizer states); ``grad_accum`` micro-batches per optimizer step;
    ``max_grad_norm`` clips the global gradient norm (None: no clipping); ``chunk_mib`` the
    size of the flat chunks parameters, gradients and optimizer states live in."""

    dp: int = 1
    tp: int = 1
    zero: int = 0
    precision: str = "fp32"
    grad_accum: int = 1
    max_grad_norm: float | None = None
    chunk_mib: float = 32.0

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Plan.{name} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Plan.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Plan.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"Plan.max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        if not self.chunk_mib > 0:
            raise ValueError(f"Plan.chunk_mib must be > 0, got {self.chunk_mib!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def check_world(self, world: int) -> None:
        if world != self.world_size:
            raise ValueError(
                f"Plan dp={self.dp} x tp={self.tp} = {self.world_size} processes, but the world has {world}; "
                f"make dp * tp equal {world}"
            )

    def to_dict(self) -> dict:
        return asdict(self)
