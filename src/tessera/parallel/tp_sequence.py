"""Megatron-style sequence parallelism between tensor-parallel regions (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models").

Under plain tensor parallelism the norms, residual adds and dropouts between the
attention and MLP blocks run on every rank over the whole sequence: each rank keeps the
same activations. Here they run on this rank's slice of the sequence instead: the
embedding's and every row-split layer's all-reduce becomes a reduce-scatter along the
sequence (dim 1), each block's input is all-gathered back before its column-split layers,
and the activations between blocks, and the norms' parameters' gradients (summed by
DTensor), are sharded over the tp ranks. The bytes moved are the same as the all-reduce's;
the memory of those activations is divided by tp.

Built from torch's own styles on the plan ``apply_tp`` resolved: ``SequenceParallel`` on
the norms, ``PrepareModuleInput`` on the attention and MLP modules, row-split layers and the
vocabulary-parallel embedding with ``output_layouts=Shard(1)``, the head with ``input_layouts=Shard(1)``. For
transformers decoders whose layers have ``input_layernorm`` / ``self_attn`` /
``post_attention_layernorm`` / ``mlp`` and a final ``norm`` (Llama, Mistral, Qwen2/3, ...).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

SEQ = Shard(1)  # (batch, sequence, hidden): the sequence dimension
LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def sequence_parallel_styles(model: nn.Module, styles: dict[str, str]) -> dict[str, object]:
    """torch ParallelStyles by module path: the plan's ``styles`` (path -> style name, as
    resolved) turned sequence-parallel, plus the norms and the blocks' input gathers."""
    base = getattr(model, "base_model", model)
    prefix = next((p for p, m in model.named_modules() if m is base), "")
    at = f"{prefix}." if prefix else ""
    layers = getattr(base, "layers", None)
    if layers is None or not all(hasattr(layers[0], n) for n in LAYER_PARTS) or not hasattr(base, "norm"):
        raise ValueError(
            f"Plan(sequence_parallel_norms=True) needs decoder layers with {', '.join(LAYER_PARTS)} and a "
            f"final norm (Llama-style); {type(model).__name__} has another layout"
        )
    out: dict[str, object] = {}
    for path, name in styles.items():
        out[path] = _sequence_style(path, name)
    for i in range(len(layers)):
        layer = f"{at}layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{layer}.{norm}"] = SequenceParallel(use_local_output=False)
        out[f"{layer}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": SEQ},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        )
        out[f"{layer}.mlp"] = PrepareModuleInput(
            input_layouts=(SEQ,), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    out[f"{at}norm"] = SequenceParallel(use_local_output=False)
    if styles.get(f"{at}embed_tokens") != "embedding_rowwise":
        raise ValueError(
            "Plan(sequence_parallel_norms=True) starts the sequence split at a vocabulary-parallel "
            f"embedding; the plan gives {at}embed_tokens {styles.get(f'{at}embed_tokens')!r}"
        )
    return out


def _sequence_style(path: str, name: str):
    if name == "rowwise":  # attention output / MLP down projection: reduce-scatter
        return RowwiseParallel(output_layouts=SEQ, use_local_output=False)
    if name == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=SEQ, use_local_output=False)
    if name in ("colwise_gather_output", "colwise_rep"):  # a head that gathers its logits
        return ColwiseParallel(input_layouts=SEQ, output_layouts=Replicate())
    if name == "vocab_logits":
        return ColwiseParallel(input_layouts=SEQ, output_layouts=Shard(-1), use_local_output=False)
    if name == "colwise":
        return ColwiseParallel()
    raise ValueError(f"Plan(sequence_parallel_norms=True) cannot take style {name!r} at {path!r}")
