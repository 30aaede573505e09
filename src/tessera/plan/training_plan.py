"""``Plan``: how one training job is spread over processes, as one validated value.

Pure data, on the planner's floor: ``tessera.plan`` answers with Plans and ``tessera.train``
runs them (``tessera.train.plan`` adds what needs a model: chunk-size checks, memory
reports)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

PRECISIONS = ("fp32", "bf16", "fp16")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOADS = (None, "auto", "static")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
SP_METHODS = ("ring", "ulysses")


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
    instead of keeping them. ``prefetch`` overlaps ZeRO's collectives with compute
    (``tessera.parallel.zero_overlap``): at ZeRO-3 the next ``prefetch`` chunks in the use order
    are all-gathered while a module computes (forward and backward), at ZeRO-2/3 up to
    ``prefetch`` gradient reduce-scatters stay in flight during backward; 0: every collective
    waits where it is issued. Results are bit-exact either way.

    ``offload`` moves ZeRO-3 chunks between memory tiers (``tessera.memory.store``): "auto"
    places them by a warm-up trace (Belady eviction, prefetch), "static" keeps only the
    working set on the fast tier; ``device_memory`` / ``host_memory`` are the bytes of model
    data (parameters, gradients, optimizer states) each rank may keep on the accelerator /
    in host memory (None: unbounded; activations come on top), ``offload_dir`` a directory
    for chunks that fit neither (None: no disk tier).

    ``pp`` pipeline stages (``tessera.parallel.pipeline`` on torch.distributed.pipelining):
    the decoder layers split evenly, ``stage_layers`` per stage, or "balanced" by an estimate of
    each layer's compute (the head counted on the last stage); ``microbatches`` per
    step (None: ``pp``, resolved when the Plan is made; each dp replica's batch is cut into
    that many), ``schedule``
    "gpipe", "1f1b" or "interleaved" with ``virtual_stages`` stages per rank. ``sp``
    sequence parallel ranks (``sp_method`` "ring", zig-zag for causal, or "ulysses"); ZeRO
    then shards over the dp x sp ranks, as DeepSpeed-Ulysses does. ``sequence_parallel_norms``
    (with tp > 1): Megatron-style, the norms and residuals between tensor-parallel regions run
    on each tp rank's slice of the sequence (``tessera.parallel.tp_sequence``). World size: dp x pp x sp x tp.

    ``ep`` expert parallel ranks, carved out of dp as DeepSpeed-MoE and Colossal-AI do: every
    mixture-of-experts layer's experts are split over ``ep`` consecutive dp ranks, each rank
    keeps its own tokens and the ep ranks of a dp row exchange them by all-to-all
    (``tessera.parallel.experts``); expert parameters are averaged and ZeRO-sharded over the
    dp / ep ranks that hold the same experts, the rest over all dp ranks. ``capacity_factor``
    (None: dropless) caps the (token, expert) pairs each rank sends one expert per layer at
    ceil(capacity_factor x its pairs / experts); the rest are dropped (their expert output is
    zero) and counted. With ``tp`` the attention (and the embedding and head) run tensor-parallel
    by the model's own plan while every MoE block is left to ``ep`` (each tp rank dispatches its
    slice of the tokens its tp group shares); with ``pp`` each stage's MoE layers are
    split over the ep ranks of that stage's dp row."""

    dp: int = 1
    tp: int = 1
    zero: int = 0
    precision: str = "fp32"
    grad_accum: int = 1
    max_grad_norm: float | None = None
    chunk_mib: float = 32.0
    block_chunks: bool = False
    activation_checkpointing: bool = False
    prefetch: int = 1
    loss_scale_init: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    offload: str | None = None
    device_memory: int | None = None
    host_memory: int | None = None
    offload_dir: str | None = None
    pp: int = 1
    microbatches: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 1
    stage_layers: tuple[int, ...] | str | None = None
    sp: int = 1
    sp_method: str = "ring"
    sequence_parallel_norms: bool = False
    ep: int = 1
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "dp",
            "tp",
            "pp",
            "sp",
            "ep",
            "virtual_stages",
            "grad_accum",
            "loss_scale_growth_interval",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Plan.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0:
            raise ValueError(
                f"Plan.prefetch must be a whole number of chunks >= 0 (0: no overlap), got {self.prefetch!r}"
            )
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"Plan.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Plan.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"Plan.max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        if not self.chunk_mib > 0:
            raise ValueError(f"Plan.chunk_mib must be > 0, got {self.chunk_mib!r}")
        if not self.loss_scale_init > 0:
            raise ValueError(f"Plan.loss_scale_init must be > 0, got {self.loss_scale_init!r}")
        for name in ("block_chunks", "activation_checkpointing", "sequence_parallel_norms"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Plan.{name} must be True or False, got {getattr(self, name)!r}")

        self._check_offload()
        self._check_pipeline()
        self._check_sequence()
        self._check_experts()

    def _check_experts(self) -> None:
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, int | float) or not cf > 0):
            raise ValueError(f"Plan.capacity_factor must be > 0 or None (dropless), got {cf!r}")
        if self.ep == 1:
            if cf is not None:
                raise ValueError(f"Plan.capacity_factor={cf!r} caps expert-parallel dispatch: set ep > 1")
            return
        if self.dp % self.ep:
            raise ValueError(
                f"Plan(ep={self.ep}) splits each dp row of ranks into expert-parallel groups: ep must divide "
                f"dp={self.dp}; use an ep that divides {self.dp}"
            )
        for name, value, wanted in (
            ("sp", self.sp, 1),
            ("offload", self.offload, None),
            ("sequence_parallel_norms", self.sequence_parallel_norms, False),
        ):
            if value != wanted:
                raise ValueError(
                    f"Plan(ep={self.ep}) with {name}={value!r} is not supported yet; use {name}={wanted!r}"
                )
        if self.pp > 1 and self.tp > 1:  # each pair is parity-tested, the three together are not
            raise ValueError(
                f"Plan(ep={self.ep}) with pp={self.pp} and tp={self.tp} together is not supported yet; "
                "use tp=1 or pp=1"
            )

    def _check_pipeline(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Plan.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        m = self.microbatches
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"Plan.microbatches must be a positive integer or None, got {m!r}")
        if m is None:  # one spelling: the field holds the count used (pp unless set)
            object.__setattr__(self, "microbatches", self.pp)
        if self.pp == 1:
            for name, default in (("microbatches", 1), ("stage_layers", None), ("virtual_stages", 1)):
                if getattr(self, name) != default:
                    raise ValueError(f"Plan.{name}={getattr(self, name)!r} needs pipeline stages: set pp > 1")
            return
        counts = self.stage_layers
        if (
            counts is not None
            and counts != "balanced"
            and (
                not isinstance(counts, tuple)
                or len(counts) != self.pp * self.virtual_stages
                or not all(isinstance(c, int) and c >= 1 for c in counts)
            )
        ):
            raise ValueError(
                f"Plan.stage_layers must be 'balanced' or a tuple of {self.pp * self.virtual_stages} positive "
                f"layer counts (pp x virtual_stages), got {counts!r}"
            )
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(f"Plan.virtual_stages={self.virtual_stages} needs schedule='interleaved'")
        if self.schedule != "gpipe" and self.microbatches < self.pp:
            raise ValueError(
                f"Plan(schedule={self.schedule!r}) needs at least pp={self.pp} micro-batches, "
                f"got microbatches={self.microbatches}; raise microbatches or use schedule='gpipe'"
            )
        # ZeRO-2/3 reduce and gather in the backward hooks of one whole-model backward; the
        # schedule runs a stage's backward once per micro-batch, so pipelined gradients are
        # averaged over dp after the schedule and only the optimizer states are sharded (ZeRO-1).
        refused = {
            "grad_accum": (self.grad_accum, 1, "micro-batches are the accumulation: raise microbatches"),
            "offload": (self.offload, None, "offload moves ZeRO-3 chunks"),
            "block_chunks": (self.block_chunks, False, "block chunks are ZeRO chunks"),
        }
        if self.zero > 1:
            raise ValueError(
                f"Plan(pp={self.pp}) with zero={self.zero} is not supported (the gradients are averaged over dp "
                "after the schedule, so optimizer states can be sharded but not gradients or parameters); use zero=1"
            )
        for name, (value, wanted, why) in refused.items():
            if value != wanted:
                raise ValueError(
                    f"Plan(pp={self.pp}) with {name}={value!r} is not supported ({why}); use {name}={wanted!r}"
                )
        if self.precision == "fp16":
            raise ValueError(
                f"Plan(pp={self.pp}) with fp16 loss scaling is not supported; use precision='bf16'"
            )

    def _check_sequence(self) -> None:
        if self.sequence_parallel_norms and (self.tp == 1 or self.pp > 1):
            raise ValueError(
                f"Plan(sequence_parallel_norms=True) shards the activations between tensor-parallel regions: "
                f"it needs tp > 1 (got tp={self.tp}) and pp=1 (got pp={self.pp})"
            )
        if self.sp_method not in SP_METHODS:
            raise ValueError(f"Plan.sp_method must be one of {SP_METHODS}, got {self.sp_method!r}")
        if self.sp == 1:
            return
        for name, value, wanted in (("offload", self.offload, None),):
            if value != wanted:
                raise ValueError(
                    f"Plan(sp={self.sp}) with {name}={value!r} is not supported yet; use {name}={wanted!r}"
                )

    @property
    def num_microbatches(self) -> int:
        """The old name of ``microbatches`` (which now holds the resolved count): kept for one
        release, with a FutureWarning, then removed."""
        import warnings

        warnings.warn("Plan.num_microbatches is renamed Plan.microbatches", FutureWarning, stacklevel=2)
        return self.microbatches

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
            given = [
                n for n in ("device_memory", "host_memory", "offload_dir") if getattr(self, n) is not None
            ]
            if given:
                raise ValueError(
                    f"Plan.{given[0]} is set but Plan.offload is None; set offload='auto' or 'static'"
                )
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
            raise ValueError(
                f"Plan(offload={self.offload!r}) does not combine with tp={self.tp} yet; use tp=1"
            )
        if self.host_memory is not None and self.offload_dir is None:
            raise ValueError(
                f"Plan.host_memory={self.host_memory} bounds host memory, so chunks beyond it need a disk tier: "
                "set Plan.offload_dir"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.sp * self.tp

    def check_world(self, world: int) -> None:
        if world != self.world_size:
            axes = " x ".join(
                f"{n}={getattr(self, n)}"
                for n in ("dp", "pp", "sp", "tp")
                if n in ("dp", "tp") or getattr(self, n) > 1
            )
            names = " * ".join(
                n for n in ("dp", "pp", "sp", "tp") if n in ("dp", "tp") or getattr(self, n) > 1
            )
            raise ValueError(
                f"Plan {axes} = {self.world_size} processes, but the world has {world}; make {names} equal {world}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def parse_bytes(text: str) -> int:
    """ "512MiB", "2GiB", "1.5GB", "4096" -> bytes (a one-line ValueError otherwise)."""
    units = {
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "b": 1,
    }
    t = text.strip().lower()
    for unit, scale in units.items():
        if t.endswith(unit):
            t, factor = t[: -len(unit)], scale
            break
    else:
        factor = 1
    try:
        return int(float(t) * factor)
    except ValueError:
        raise ValueError(f"{text!r} is not a size: write e.g. 512MiB, 2GiB or a number of bytes") from None
