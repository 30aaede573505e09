"""Megatron-style tensor parallel plans, keyed by module path, applied with torch's DTensor
``parallelize_module`` (column-parallel / row-parallel linears, vocab-parallel embeddings,
vocab-sharded logits for a parallel cross-entropy).

One plan per model family. A plan is checked when applied: every pattern must match a
module, and the degree must divide each split dimension (heads, hidden and intermediate
sizes, vocabulary) — a ``ValueError`` naming the value and the module otherwise.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


def _styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "vocab_embedding": RowwiseParallel(input_layouts=Replicate()),
        "vocab_logits": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


@dataclass(frozen=True)
class TPPlan:
    """``layers`` maps module-path patterns to a style name; ``heads`` names modules whose
    head count attribute must be divided by the degree (the model reads it to reshape)."""

    family: str
    layers: dict[str, str]
    heads: dict[str, str] = field(default_factory=dict)  # module pattern -> attribute
    vocab_parallel_loss: bool = False
    prepare: Callable[[nn.Module, int], None] | None = None  # layout changes the split needs


LLAMA = TPPlan(
    family="llama",
    layers={
        "model.embed_tokens": "vocab_embedding",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "vocab_logits",
    },
    vocab_parallel_loss=True,
)

BERT = TPPlan(
    family="bert",
    layers={
        "bert.embeddings.word_embeddings": "vocab_embedding",
        "bert.encoder.layer.*.attention.self.query": "colwise",
        "bert.encoder.layer.*.attention.self.key": "colwise",
        "bert.encoder.layer.*.attention.self.value": "colwise",
        "bert.encoder.layer.*.attention.output.dense": "rowwise",
        "bert.encoder.layer.*.intermediate.dense": "colwise",
        "bert.encoder.layer.*.output.dense": "rowwise",
    },
)

BERT_MLM = TPPlan(
    family="bert_mlm",
    layers={**BERT.layers, "cls.predictions.decoder": "vocab_logits"},
    vocab_parallel_loss=True,
)

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
    heads={"blocks.*.attn": "num_heads"},
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

    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        if not isinstance(attn.c_attn, Conv1D):
            continue  # already prepared
        width = attn.embed_dim
        if attn.num_heads % degree:
            raise ValueError(f"tp={degree} does not divide the {attn.num_heads} heads of GPT-2 attention")
        per = width // degree
        rows = gpt2_qkv_rows(width, degree)
        attn.c_attn = _linear_from_conv1d(attn.c_attn, rows)
        attn.c_proj = _linear_from_conv1d(attn.c_proj)
        mlp.c_fc = _linear_from_conv1d(mlp.c_fc)
        mlp.c_proj = _linear_from_conv1d(mlp.c_proj)
        attn.split_size = per
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


GPT2 = TPPlan(
    family="gpt2",
    layers={
        "transformer.wte": "vocab_embedding",
        "transformer.h.*.attn.c_attn": "colwise",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "vocab_logits",
    },
    prepare=prepare_gpt2,
    vocab_parallel_loss=True,
)


# Looked up by class name, first match wins: "BertForMaskedLM" before any other "Bert...".
PLANS = {"gpt2": GPT2, "llama": LLAMA, "bertformaskedlm": BERT_MLM, "bert": BERT, "dit": DIT}


def plan_for(model: nn.Module) -> TPPlan:
    name = type(model).__name__.lower()
    for family, plan in PLANS.items():
        if family in name:
            return plan
    raise ValueError(
        f"no tensor parallel plan for {type(model).__name__}; plans exist for {sorted(PLANS)} "
        "(pass tp_plan=TPPlan(...) for another model)"
    )


def _split_size(module: nn.Module, style: str) -> tuple[str, int]:
    if isinstance(module, nn.Embedding):
        return "vocabulary", module.num_embeddings
    if isinstance(module, nn.Linear):
        return (
            ("output features", module.out_features)
            if style in ("colwise", "vocab_logits")
            else (
                "input features",
                module.in_features,
            )
        )
    raise ValueError(
        f"tensor parallel style {style!r} applies to nn.Linear or nn.Embedding, got {type(module).__name__}"
    )


def apply_tp(model: nn.Module, plan: TPPlan, device_mesh, degree: int) -> nn.Module:
    """Shard ``model`` in place over ``device_mesh`` (1-D, size ``degree``) by ``plan``."""
    from torch.distributed.tensor.parallel import parallelize_module

    _check_hf_heads(model, degree)
    if plan.prepare is not None:
        plan.prepare(model, degree)
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for pattern, style in plan.layers.items():
        hits = [name for name in modules if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise ValueError(
                f"tensor parallel plan {plan.family!r}: pattern {pattern!r} matches no module of {type(model).__name__}"
            )
        for name in hits:
            what, size = _split_size(modules[name], style)
            if size % degree:
                raise ValueError(f"tp={degree} does not divide the {what} ({size}) of module {name!r}")
            resolved[name] = style
    for pattern, attribute in plan.heads.items():
        hits = [name for name in modules if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise ValueError(f"tensor parallel plan {plan.family!r}: pattern {pattern!r} matches no module")
        for name in hits:
            heads = getattr(modules[name], attribute)
            if heads % degree:
                raise ValueError(
                    f"tp={degree} does not divide the {heads} heads ({attribute}) of module {name!r}"
                )
    _check_hf_heads(model, degree)
    tied = _tied_pairs(model)
    styles = _styles()
    parallelize_module(model, device_mesh, {name: styles[style] for name, style in resolved.items()})
    for pattern, attribute in plan.heads.items():
        for name in modules:
            if fnmatch.fnmatchcase(name, pattern):
                setattr(modules[name], attribute, getattr(modules[name], attribute) // degree)
    for (owner, attr), (source, source_attr) in tied:
        # parallelize_module split the tie: restore it, keeping the sharded (DTensor) one
        mine, theirs = getattr(owner, attr), getattr(source, source_attr)
        if hasattr(mine, "placements") and not hasattr(theirs, "placements"):
            setattr(source, source_attr, mine)
        else:
            setattr(owner, attr, theirs)
    return model


def _check_hf_heads(model: nn.Module, degree: int) -> None:
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "hidden_size"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value % degree:
            raise ValueError(f"tp={degree} does not divide {key}={value} of {type(model).__name__}")


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
