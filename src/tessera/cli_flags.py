"""Command-line flags generated from the fields of a settings dataclass (``Plan``,
``ParallelConfig``), in one place: a field ``grad_accum`` is the flag ``--grad-accum``, its
type comes from the annotation, its choices from the class's own validation constants, its
default is the class's (shown in the help; a flag not given is not passed, so the class
decides), its help from the descriptions below. ``as_flags`` turns a value back into the
flags that make it, so a planner's choice can be pasted. Old flag names keep working for one
release through ``add_renamed`` (a FutureWarning naming the new one).

Light on purpose: every command builds its parser from this module (no torch)."""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from tessera.diffusion import layout
from tessera.train import plan


class UserError(Exception):
    """A condition the user can fix: the command line prints it as one line, exit status 2."""


def flag(name: str) -> str:
    """A field's flag: ``grad_accum`` -> ``--grad-accum``."""
    return "--" + name.replace("_", "-")


def _bytes(text: str) -> int:
    try:
        return plan.parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _layer_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts such as 4,4,3, got {text!r}") from None
    return counts


def _layer_counts_or_balanced(text: str) -> tuple[int, ...] | str:
    return text if text == "balanced" else _layer_counts(text)


@dataclass(frozen=True)
class Settings:
    """How one settings dataclass appears on the command line."""

    cls: type
    title: str
    help: Mapping[str, str]  # every field's description
    choices: Mapping[str, tuple] = field(default_factory=dict)
    types: Mapping[str, Callable[[str], object]] = field(default_factory=dict)
    metavars: Mapping[str, str] = field(default_factory=dict)

    def fields(self) -> list[dataclasses.Field]:
        return list(dataclasses.fields(self.cls))


PLAN = Settings(
    cls=plan.Plan,
    title="plan (tessera.Plan: how training is spread over the processes)",
    help={
        "dp": "data parallel degree",
        "tp": "tensor parallel degree",
        "zero": "ZeRO stage over the dp ranks: 1 shards optimizer states, 2 also gradients, 3 also parameters",
        "precision": "bf16: autocast with fp32 master weights; fp16: the same with dynamic loss scaling",
        "grad_accum": "micro-batches accumulated per optimizer step (without a pipeline)",
        "max_grad_norm": "clip the global gradient norm to this (default: no clipping)",
        "chunk_mib": "ZeRO chunk size in MiB",
        "block_chunks": "a new ZeRO chunk at every transformer block",
        "activation_checkpointing": "recompute each transformer block's activations in backward",
        "prefetch": "ZeRO chunks whose collectives overlap compute: ZeRO-3 all-gathers ahead, ZeRO-2/3 "
        "reduce-scatters in flight (0: none)",
        "loss_scale_init": "fp16: the first loss scale",
        "loss_scale_growth_interval": "fp16: clean steps in a row that double the loss scale",
        "offload": "move ZeRO-3 chunks between device, host and disk: auto (by a warm-up trace) or static",
        "device_memory": "offload: model data each rank keeps on the device, e.g. 8GiB (default: unbounded)",
        "host_memory": "offload: model data each rank keeps in host memory, e.g. 16GiB (needs --offload-dir)",
        "offload_dir": "offload: a directory for chunks that fit neither device nor host",
        "pp": "pipeline stages",
        "microbatches": "pipeline micro-batches per step (default: pp)",
        "schedule": "pipeline schedule",
        "virtual_stages": "pipeline stages per rank (interleaved schedule)",
        "stage_layers": "decoder layers per pipeline stage, e.g. 4,4,3, or 'balanced' (default: even)",
        "sp": "sequence parallel degree",
        "sp_method": "sequence parallel attention: ring (zig-zag for causal) or ulysses (all-to-all)",
        "sequence_parallel_norms": "with tp > 1: norms and residuals on each tp rank's slice of the sequence",
        "ep": "expert parallel degree (divides dp): each MoE layer's experts split over ep dp ranks",
        "capacity_factor": "with ep > 1: cap each rank's tokens per expert at this x its fair share, "
        "dropping the rest (default: dropless)",
    },
    choices={
        "zero": plan.ZERO_STAGES,
        "precision": plan.PRECISIONS,
        "offload": tuple(o for o in plan.OFFLOADS if o is not None),
        "schedule": plan.SCHEDULES,
        "sp_method": plan.SP_METHODS,
    },
    types={
        "device_memory": _bytes,
        "host_memory": _bytes,
        "stage_layers": _layer_counts_or_balanced,
    },
    metavars={"device_memory": "SIZE", "host_memory": "SIZE", "offload_dir": "DIR", "stage_layers": "COUNTS"},
)

LAYOUT = Settings(
    cls=layout.ParallelConfig,
    title="layout (tessera.ParallelConfig: how sampling is spread over the processes)",
    help={
        "pipefusion": "PipeFusion degree (pipeline stages over patches)",
        "patches": "PipeFusion patches along the height (default: the PipeFusion degree)",
        "warmup_steps": "PipeFusion / DistriFusion steps run synchronously before stale K/V is used",
        "stage_layers": "transformer blocks per PipeFusion stage, e.g. 14,14 (default: even)",
        "ulysses": "Ulysses (all-to-all) sequence parallel degree",
        "ring": "Ring attention sequence parallel degree",
        "cfg_parallel": "the two classifier-free guidance branches on two ranks",
        "tp": "tensor parallel degree (baseline)",
        "distrifusion": "DistriFusion degree (baseline)",
    },
    types={"stage_layers": _layer_counts},
    metavars={"stage_layers": "COUNTS"},
)


def _type(settings: Settings, f: dataclasses.Field) -> Callable[[str], object]:
    if f.name in settings.types:
        return settings.types[f.name]
    kind = str(f.type).split("|")[0].strip()
    if kind not in ("int", "float", "str"):
        raise TypeError(f"{settings.cls.__name__}.{f.name}: give a parser for type {f.type}")
    return {"int": int, "float": float, "str": str}[kind]


def add_fields(
    parser: argparse.ArgumentParser,
    settings: Settings,
    *,
    only: Iterable[str] | None = None,
    defaults: Mapping[str, object] | None = None,
    default_text: Mapping[str, str] | None = None,
) -> None:
    """A flag for each field (or each in ``only``). ``defaults``: this verb's own defaults
    (passed to the class when the flag is not given); ``default_text``: the default as words,
    where it is derived (e.g. dp from --nproc)."""
    defaults, default_text = dict(defaults or {}), dict(default_text or {})
    names = [f.name for f in settings.fields()]
    unknown = sorted(set(only or ()) - set(names)) + sorted(set(defaults) - set(names))
    if unknown:
        raise ValueError(
            f"{settings.cls.__name__} has no field {unknown[0]!r}; its fields: {', '.join(names)}"
        )
    group = parser.add_argument_group(settings.title)
    for f in settings.fields():
        if only is not None and f.name not in only:
            continue
        if f.name not in settings.help:
            raise ValueError(f"{settings.cls.__name__}.{f.name} has no description in tessera.cli_flags")
        default = defaults.get(f.name, f.default)
        shown = default_text.get(f.name, None if default in (None, False) else str(default))
        text = settings.help[f.name]
        if shown and "(default" not in text:
            text += f" (default: {shown})"
        if str(f.type) == "bool":
            group.add_argument(
                flag(f.name), dest=f.name, action="store_true", default=defaults.get(f.name), help=text
            )
            continue
        kind = _type(settings, f)
        group.add_argument(
            flag(f.name),
            dest=f.name,
            type=kind,
            choices=settings.choices.get(f.name),
            default=defaults.get(f.name),
            metavar=None
            if f.name in settings.choices
            else settings.metavars.get(f.name, _METAVARS.get(kind)),
            help=text,
        )


_METAVARS = {int: "N", float: "X"}


def given(args: argparse.Namespace, settings: Settings) -> dict[str, object]:
    """The fields whose flags were given (or that this verb defaults), by field name."""
    values = {f.name: getattr(args, f.name, None) for f in settings.fields()}
    return {name: v for name, v in values.items() if v is not None and v is not False}


def _changed(value: object, settings: Settings) -> list[tuple[str, object]]:
    """(field, value as text or True) for each field where dropping it would change ``value``."""
    out = []
    for f in settings.fields():
        current = getattr(value, f.name)
        try:
            same = dataclasses.replace(value, **{f.name: f.default}) == value
        except ValueError:  # the value needs this setting (e.g. offload with its budget)
            same = False
        if not same:
            text = ",".join(map(str, current)) if isinstance(current, tuple) else current
            out.append((f.name, True if isinstance(current, bool) else str(text)))
    return out


def as_flags(value: object, settings: Settings) -> str:
    """The flags that make ``value``: a field's flag where dropping it would change the value."""
    return " ".join(flag(n) if v is True else f"{flag(n)} {v}" for n, v in _changed(value, settings))


def as_settings(value: object, settings: Settings) -> str:
    """``value`` in words, the fields ``as_flags`` would give: ``dp=2 zero=3 grad_accum=2``."""
    return " ".join(n if v is True else f"{n}={v}" for n, v in _changed(value, settings))


class _Renamed(argparse.Action):
    """An old flag name: does what the new one does, with a FutureWarning naming it."""

    def __init__(self, option_strings, dest, new: str, store_true: bool = False, **kwargs):
        self.new = new
        self.store_true = store_true
        super().__init__(option_strings, dest, nargs=0 if store_true else None, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        warn_renamed(option_string, self.new)
        setattr(namespace, self.dest, True if self.store_true else values)


def warn_renamed(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is renamed {new}; the old name goes in the next release", FutureWarning, stacklevel=3
    )


def add_renamed(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """``old`` as a hidden alias of the flag ``new`` already on ``parser``."""
    target = next(a for a in parser._actions if new in a.option_strings)
    parser.add_argument(
        old,
        action=_Renamed,
        dest=target.dest,
        new=new,
        store_true=isinstance(target, argparse._StoreTrueAction),
        **(
            {}
            if isinstance(target, argparse._StoreTrueAction)
            else {"type": target.type, "choices": target.choices}
        ),
        help=argparse.SUPPRESS,
    )
