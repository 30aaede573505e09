"""Megatron-style tensor parallel plans, keyed by module path, applied with torch's DTensor
``parallelize_module``. Style names are transformers' (``tessera.parallel.tp_styles``).

Which plan a model gets (``plan_for``):

- a transformers model whose config ships ``base_model_tp_plan`` gets that plan, as
  transformers itself resolves it (``model.tp_plan``: the base plan under the base model's
  prefix, the vocabulary-parallel input embedding, the class's ``_tp_plan`` for the head);
- models that ship none get Tessera's: GPT-2 and BERT (chosen by ``config.model_type``) and
  Tessera's DiT (by ``isinstance``). Their heads are vocabulary-sharded for ``loss_parallel``.

A plan is checked when applied: every style is known and supported, every pattern matches a
module, the degree divides each split dimension and the attention heads — a ``ValueError``
naming the value and the module otherwise.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tessera.models.dit import DiT
from tessera.parallel.tp_styles import STYLES, Style, lookup


@dataclass(frozen=True)
class TPPlan:
    """``layers`` maps module-path patterns (``*`` stands for one path segment, e.g. a layer
    number) to a style name; ``head_counts`` names modules whose head count attribute must be
    divided by the degree (the model reads it to reshape); ``prepare`` makes layout changes
    the split needs before it is applied."""

    family: str
    layers: dict[str, str]
    head_counts: dict[str, str] = field(default_factory=dict)  # module pattern -> attribute
    prepare: Callable[[nn.Module, int], None] | None = None

    @property
    def vocab_parallel_loss(self) -> bool:
        """The logits are a vocabulary-sharded DTensor: the loss runs under ``loss_parallel``."""
        return "vocab_logits" in self.layers.values()


DIT = TPPlan(
    family="dit",
    layers={
        "blocks.*.attn.to_q": "colwise",
        "blocks.*.attn.to_k": "colwise",
        "blocks.*.attn.to_v": "colwise",
        "blocks.*.attn.to_out": "rowwise",
        "blocks.*.mlp.fc1": "colwise",
        "blocks.*.mlp.fc2": "rowwise",
    },
    head_counts={"blocks.*.attn": "num_heads"},
)


def _linear_from_conv1d(conv, rows=None) -> nn.Linear:
    """GPT-2's Conv1D (y = x W + b, W stored in x out) as the nn.Linear computing the same,
    optionally with its output features reordered by ``rows``."""
    weight, bias = conv.weight.detach().t(), conv.bias.detach()
    if rows is not None:
        weight, bias = weight[rows], bias[rows]
    linear = nn.Linear(weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return linear


def prepare_gpt2(model: nn.Module, degree: int) -> None:
    """Make GPT-2 shardable by the plan: its Conv1D layers become nn.Linear (the transposed
    weight), and the fused q|k|v projection's output features are reordered rank by rank
    (rank r's block holds its heads' q, then k, then v), so a column split hands every rank
    whole heads; each attention then splits its local q|k|v by its local width."""
    from transformers.pytorch_utils import Conv1D

    for block in model.base_model.h:
        attn, mlp = block.attn, block.mlp
        if not isinstance(attn.c_attn, Conv1D):
            continue  # already prepared
        width = attn.embed_dim
        if attn.num_heads % degree:
            raise ValueError(f"tp={degree} does not divide the {attn.num_heads} heads of GPT-2 attention")
        rows = gpt2_qkv_rows(width, degree)
        attn.c_attn = _linear_from_conv1d(attn.c_attn, rows)
        attn.c_proj = _linear_from_conv1d(attn.c_proj)
        mlp.c_fc = _linear_from_conv1d(mlp.c_fc)
        mlp.c_proj = _linear_from_conv1d(mlp.c_proj)
        attn.split_size = width // degree
    model._tessera_gpt2_tp_degree = degree  # tessera.train.export undoes the layout change


def gpt2_qkv_rows(width: int, degree: int) -> torch.Tensor:
    """Fused q|k|v output features ordered rank by rank: rank r's block is its q, k, v heads."""
    per = width // degree
    return torch.cat(
        [
            torch.arange(part * width + r * per, part * width + (r + 1) * per)
            for r in range(degree)
            for part in range(3)
        ]
    )


@dataclass(frozen=True)
class _OwnPlan:
    """A plan for a transformers family that ships none, keyed relative to its base model as
    ``base_model_tp_plan`` is; ``head`` entries apply where the model has that module."""

    base: dict[str, str]
    head: dict[str, str]
    prepare: Callable[[nn.Module, int], None] | None = None

    def for_model(self, model: nn.Module) -> TPPlan:
        prefix = "" if model.base_model is model else f"{model.base_model_prefix}."
        modules = dict(model.named_modules())
        layers = {prefix + k: v for k, v in self.base.items()}
        layers |= {k: v for k, v in self.head.items() if k in modules}
        return TPPlan(family=model.config.model_type, layers=layers, prepare=self.prepare)


# By config.model_type: transformers ships no plan for these families.
OWN_PLANS = {
    "gpt2": _OwnPlan(
        base={
            "wte": "embedding_rowwise",
            "h.*.attn.c_attn": "colwise",
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        head={"lm_head": "vocab_logits"},
        prepare=prepare_gpt2,
    ),
    "bert": _OwnPlan(
        base={
            "embeddings.word_embeddings": "embedding_rowwise",
            "encoder.layer.*.attention.self.query": "colwise",
            "encoder.layer.*.attention.self.key": "colwise",
            "encoder.layer.*.attention.self.value": "colwise",
            "encoder.layer.*.attention.output.dense": "rowwise",
            "encoder.layer.*.intermediate.dense": "colwise",
            "encoder.layer.*.output.dense": "rowwise",
        },
        head={"cls.predictions.decoder": "vocab_logits"},  # BertForMaskedLM's, tied to the embedding
    ),
}


def _ships_plan(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "base_model_tp_plan", None) or getattr(text, "base_model_tp_plan", None))


def plan_for(model: nn.Module) -> TPPlan:
    """The model's own plan where transformers ships one, else Tessera's (see the module doc)."""
    if isinstance(model, DiT):
        return DIT
    config = getattr(model, "config", None)
    if config is not None and _ships_plan(config) and getattr(model, "tp_plan", None):
        return TPPlan(family=config.model_type, layers=dict(model.tp_plan))
    own = OWN_PLANS.get(getattr(config, "model_type", None))
    if own is not None:
        return own.for_model(model)
    raise ValueError(
        f"no tensor parallel plan for {type(model).__name__}; plans exist for transformers models whose "
        f"config ships base_model_tp_plan, for model types {sorted(OWN_PLANS)} and for Tessera's DiT "
        "(pass tp_plan=TPPlan(...) for another model)"
    )


def path_matches(pattern: str, name: str) -> bool:
    """``*`` matches one path segment (``layers.*.mlp`` matches ``layers.3.mlp`` only)."""
    parts, segments = pattern.split("."), name.split(".")
    return len(parts) == len(segments) and all(map(fnmatch.fnmatchcase, segments, parts))


def _resolve(model: nn.Module, plan: TPPlan, degree: int) -> dict[str, Style]:
    """Module path -> style (in the model's module order), every entry checked."""
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[str, str]] = {}  # path -> (pattern, style name)
    for pattern, name in plan.layers.items():
        lookup(name, f"plan {plan.family!r}, pattern {pattern!r}")
        hits = [path for path in modules if path_matches(pattern, path)]
        if not hits and any(path_matches(pattern, n) for n, _ in model.named_parameters()):
            raise ValueError(
                f"tensor parallel plan {plan.family!r}: pattern {pattern!r} names parameters, not modules; "
                "Tessera applies styles to modules"
            )
        if not hits:
            raise ValueError(
                f"tensor parallel plan {plan.family!r}: pattern {pattern!r} matches no module of {type(model).__name__}"
            )
        for path in hits:
            if path in chosen and chosen[path][1] != name:
                raise ValueError(
                    f"module {path!r} matches pattern {chosen[path][0]!r} ({chosen[path][1]}) and "
                    f"{pattern!r} ({name}); give it one style"
                )
            chosen[path] = (pattern, name)
    resolved: dict[str, Style] = {}
    for path in (p for p in modules if p in chosen):
        name = chosen[path][1]
        style = lookup(name, path)
        style.check_module(name, path, modules[path])
        split = style.split_size(modules[path])
        if split is not None and split[1] % degree:
            raise ValueError(f"tp={degree} does not divide the {split[0]} ({split[1]}) of module {path!r}")
        resolved[path] = style
    return resolved


def _head_modules(model: nn.Module, plan: TPPlan, degree: int) -> list[tuple[nn.Module, str]]:
    found = []
    for pattern, attribute in plan.head_counts.items():
        hits = [(path, m) for path, m in model.named_modules() if path_matches(pattern, path)]
        if not hits:
            raise ValueError(f"tensor parallel plan {plan.family!r}: pattern {pattern!r} matches no module")
        for path, module in hits:
            heads = getattr(module, attribute)
            if heads % degree:
                raise ValueError(
                    f"tp={degree} does not divide the {heads} heads ({attribute}) of module {path!r}"
                )
            found.append((module, attribute))
    return found


def _check_config_heads(model: nn.Module, plan: TPPlan, degree: int) -> None:
    """A column split of q/k/v must hand every rank whole query and key/value heads."""
    if "colwise" not in plan.layers.values():
        return  # no output split by heads (e.g. fused q|k|v gathered whole)
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value % degree:
            raise ValueError(f"tp={degree} does not divide {key}={value} of {type(model).__name__}")


def check_plan(model: nn.Module, plan: TPPlan, degree: int) -> None:
    """Every check :func:`apply_tp` makes before it shards (styles, patterns, the degree
    against each split size and head count), without sharding: attributes only, so a model
    on the meta device will do."""
    _check_config_heads(model, plan, degree)
    _resolve(model, plan, degree)
    _head_modules(model, plan, degree)


def apply_tp(
    model: nn.Module,
    plan: TPPlan,
    device_mesh,
    degree: int,
    *,
    src_data_rank: int | None = 0,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Shard ``model`` in place over ``device_mesh`` (1-D, size ``degree``) by ``plan``.
    ``src_data_rank`` as torch's ``parallelize_module``: the tp rank whose weights every rank
    takes (scattered from it), or None when every rank already holds the same whole model and
    takes its own slice without communicating. ``sequence_parallel``: the activations
    between the blocks sharded on the sequence (``tessera.parallel.tp_sequence``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    _check_config_heads(model, plan, degree)
    if plan.prepare is not None:
        plan.prepare(model, degree)
    resolved = _resolve(model, plan, degree)
    head_modules = _head_modules(model, plan, degree)
    tied = _tied_pairs(model)
    if sequence_parallel:
        from tessera.parallel.tp_sequence import sequence_parallel_styles

        names = {id(style): name for name, style in STYLES.items()}
        styles = sequence_parallel_styles(model, {path: names[id(s)] for path, s in resolved.items()})
    else:
        styles = {path: style.build() for path, style in resolved.items()}
    parallelize_module(model, device_mesh, styles, src_data_rank=src_data_rank)
    for module, attribute in head_modules:
        setattr(module, attribute, getattr(module, attribute) // degree)
    _restore_ties(tied)
    return model


def gather_tp(model: nn.Module, plan: TPPlan, degree: int) -> nn.Module:
    """Undo :func:`apply_tp` (a collective over the tensor parallel ranks): every sharded
    Linear or Embedding is rebuilt whole from its gathered weights, head counts are restored.
    For plans without a layout change or tied weights (the DiT's)."""
    if plan.prepare is not None or _tied_pairs(model):
        raise ValueError(f"gather_tp cannot undo plan {plan.family!r}: it changes the layout or ties weights")
    for path in _resolve(model, plan, degree):
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, _whole(path, model.get_submodule(path)))
    for pattern, attribute in plan.head_counts.items():
        for path, module in model.named_modules():
            if path_matches(pattern, path):
                setattr(module, attribute, getattr(module, attribute) * degree)
    return model


def _whole(path: str, module: nn.Module) -> nn.Module:
    """A fresh module of the same kind holding ``module``'s DTensor parameters whole."""
    if isinstance(module, nn.Linear):
        fresh = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
    elif isinstance(module, nn.Embedding):
        fresh = nn.Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx, device="meta")
    else:
        raise ValueError(
            f"gather_tp rebuilds nn.Linear and nn.Embedding, not module {path!r} ({type(module).__name__})"
        )
    for name, p in module.named_parameters(recurse=False):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        setattr(fresh, name, nn.Parameter(full.detach(), requires_grad=p.requires_grad))
    return fresh.train(module.training)


def _tied_pairs(model: nn.Module) -> list:
    seen: dict[int, tuple[nn.Module, str]] = {}
    pairs = []
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                pairs.append(((module, attr), seen[id(p)]))
            else:
                seen[id(p)] = (module, attr)
    return pairs


def _restore_ties(tied: list) -> None:
    """parallelize_module gave each side of a tie its own parameter: tie them again to the
    sharded (DTensor) one, which must be split the same way for both uses."""
    for (owner, attr), (source, source_attr) in tied:
        mine, theirs = getattr(owner, attr), getattr(source, source_attr)
        mine_at, theirs_at = getattr(mine, "placements", None), getattr(theirs, "placements", None)
        if mine_at is not None and theirs_at is not None and mine_at != theirs_at:
            raise ValueError(
                f"tied parameter {attr!r} of {type(owner).__name__} is split as {mine_at} but its tie "
                f"{source_attr!r} of {type(source).__name__} as {theirs_at}; tie weights only across equal splits"
            )
        if mine_at is not None and theirs_at is None:
            setattr(source, source_attr, mine)
        else:
            setattr(owner, attr, theirs)
