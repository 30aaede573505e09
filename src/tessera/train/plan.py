"""``Plan``: how one training job is spread over processes, as one validated value."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOADS = (None, "auto", "static")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Data parallel degree ``dp`` and tensor parallel degree ``tp`` (``dp * tp`` = world
    size); ``zero`` 0-3 (what data-parallel ranks shard: 1 optimizer states, 2 also
    gradients, 3 also parameters); ``precision`` "fp32", "bf16" (bf16 autocast, fp32 master
    weights and optimizer states) or "fp16" (fp16 autocast with dynamic loss scaling as
    ``torch.amp.GradScaler`` does it: the loss is multiplied by a scale starting at
    ``loss_scale_init``; a step whose gradients overflow is skipped and halves the scale;
    ``loss_scale_growth_interval`` clean steps in a row double it); ``grad_accum``
    micro-batches per optimizer step; ``max_grad_norm`` clips the global gradient norm
    (None: no clipping); ``chunk_mib`` the size of the flat chunks parameters, gradients and
    optimizer states live in; ``block_chunks`` starts a new chunk at every transformer
    block, so a block's parameters are chunks of their own (the granularity FSDP2's
    ``fully_shard`` per block has); ``activation_checkpointing`` recomputes each
    transformer block's activations in backward (``torch.utils.checkpoint``, non-reentrant)
    instead of keeping them.

    ``offload`` moves ZeRO-3 chunks between memory tiers (``tessera.memory.store``): "auto"
    places them by a warm-up trace (Belady eviction, prefetch), "static" keeps only the
    working set on the fast tier; ``device_memory`` / ``host_memory`` are the bytes of model
    data (parameters, gradients, optimizer states) each rank may keep on the accelerator /
    in host memory (None: unbounded; activations come on top), ``offload_dir`` a directory
    for chunks that fit neither (None: no disk tier)."""

    dp: int = 1
    tp: int = 1
    zero: int = 0
    precision: str = "fp32"
    grad_accum: int = 1
    max_grad_norm: float | None = None
    chunk_mib: float = 32.0
    block_chunks: bool = False
    activation_checkpointing: bool = False
    loss_scale_init: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    offload: str | None = None
    device_memory: int | None = None
    host_memory: int | None = None
    offload_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "grad_accum", "loss_scale_growth_interval"):
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
        if not self.loss_scale_init > 0:
            raise ValueError(f"Plan.loss_scale_init must be > 0, got {self.loss_scale_init!r}")
        for name in ("block_chunks", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Plan.{name} must be True or False, got {getattr(self, name)!r}")

        self._check_offload()

    def _check_offload(self) -> None:
        if self.offload not in OFFLOADS:
            raise ValueError(f"Plan.offload must be one of {OFFLOADS}, got {self.offload!r}")
        for name in ("device_memory", "host_memory"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"Plan.{name} must be a positive number of bytes or None, got {value!r}")
        if self.offload_dir is not None and not isinstance(self.offload_dir, str | os.PathLike):
            raise ValueError(f"Plan.offload_dir must be a directory path or None, got {self.offload_dir!r}")
        if self.offload is None:
            given = [n for n in ("device_memory", "host_memory", "offload_dir") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"Plan.{given[0]} is set but Plan.offload is None; set offload='auto' or 'static'")
            return
        if self.zero != 3:
            raise ValueError(
                f"Plan(offload={self.offload!r}) moves ZeRO-3 chunks between tiers, got zero={self.zero}; use zero=3"
            )
        if self.precision == "fp16":
            raise ValueError(
                f"Plan(offload={self.offload!r}) with fp16 loss scaling is not supported yet; use precision='bf16'"
            )
        if self.tp != 1:
            raise ValueError(f"Plan(offload={self.offload!r}) does not combine with tp={self.tp} yet; use tp=1")
        if self.host_memory is not None and self.offload_dir is None:
            raise ValueError(
                f"Plan.host_memory={self.host_memory} bounds host memory, so chunks beyond it need a disk tier: "
                "set Plan.offload_dir"
            )

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
