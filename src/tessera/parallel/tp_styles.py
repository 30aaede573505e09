"""Tensor parallel style names, as transformers' plans spell them, mapped to torch DTensor
``ParallelStyle``s.

transformers (``transformers.distributed.tensor_parallel``) registers its own layer classes
under these names; Tessera reads the same names and applies torch's ``parallelize_module``
instead, so every sharded weight is a DTensor and every collective is DTensor's (counted by
``tessera.runtime.functional_collectives.FunctionalCollectives``). Between modules activations are plain,
replicated tensors except where a name says otherwise, as in transformers:

    colwise                   Linear, weight and bias split on the output features; input
                              replicated, output this rank's slice (e.g. its attention heads)
    colwise_gather_output,    Linear split on the output features, output all-gathered
    colwise_rep               (transformers registers both names for the same layer)
    rowwise                   Linear, weight split on the input features, bias replicated;
                              input this rank's slice, partial outputs all-reduced
    rowwise_split_input,      Linear split on the input features with a replicated input
    rowwise_rep               (each rank takes its slice locally), output all-reduced
    embedding_rowwise         Embedding split on the vocabulary, partial lookups all-reduced
    embedding_colwise         Embedding split on the embedding width, slices all-gathered
    replicated_with_grad_allreduce
                              a per-head norm between a colwise and a rowwise layer (Qwen3's
                              q_norm/k_norm): parameters replicated, gradient summed over ranks
    vocab_logits              (Tessera's own) Linear split on the output features, output left
                              a vocabulary-sharded DTensor for ``loss_parallel``'s cross-entropy

Every other name transformers knows is refused by name (``REFUSED`` says why), and a name
neither knows is refused as unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel


@dataclass(frozen=True)
class Style:
    module: type[nn.Module]  # what the style applies to
    split: str | None  # the module's attribute holding the size split over the ranks (None: none)
    build: Callable[[], object]  # a fresh torch ParallelStyle

    def split_size(self, module: nn.Module) -> tuple[str, int] | None:
        """(what is split, its size) on ``module``, or None when nothing is split."""
        if self.split is None:
            return None
        return _SPLIT_NAMES[self.split], getattr(module, self.split)

    def check_module(self, name: str, path: str, module: nn.Module) -> None:
        if not isinstance(module, self.module):
            raise ValueError(
                f"tensor parallel style {name!r} applies to {self.module.__name__}, "
                f"but module {path!r} is a {type(module).__name__}"
            )


_SPLIT_NAMES = {
    "out_features": "output features",
    "in_features": "input features",
    "num_embeddings": "vocabulary",
    "embedding_dim": "embedding width",
}


def _grad_allreduce() -> SequenceParallel:
    # torch's SequenceParallel replicates the module's parameters and declares its local input
    # sharded on a dimension. Here that input holds this rank's heads; a norm over the last
    # dimension computes the same on any split of the leading ones, so dim 0 is declared. DTensor
    # then sees each rank's weight gradient as partial and sums it over the ranks, which is
    # what transformers' ReplicatedWithGradAllReduce does with a gradient hook.
    return SequenceParallel(sequence_dim=0, use_local_output=True)


def _gathered_colwise() -> ColwiseParallel:
    return ColwiseParallel(output_layouts=Replicate())


def _replicated_input_rowwise() -> RowwiseParallel:
    return RowwiseParallel(input_layouts=Replicate())


STYLES: dict[str, Style] = {
    "colwise": Style(nn.Linear, "out_features", ColwiseParallel),
    "colwise_gather_output": Style(nn.Linear, "out_features", _gathered_colwise),
    "colwise_rep": Style(nn.Linear, "out_features", _gathered_colwise),
    "rowwise": Style(nn.Linear, "in_features", RowwiseParallel),
    "rowwise_split_input": Style(nn.Linear, "in_features", _replicated_input_rowwise),
    "rowwise_rep": Style(nn.Linear, "in_features", _replicated_input_rowwise),
    # torch's RowwiseParallel on an Embedding splits its rows (the vocabulary) and all-reduces
    "embedding_rowwise": Style(nn.Embedding, "num_embeddings", _replicated_input_rowwise),
    # torch's ColwiseParallel on an Embedding splits its columns (the width)
    "embedding_colwise": Style(nn.Embedding, "embedding_dim", _gathered_colwise),
    "replicated_with_grad_allreduce": Style(nn.Module, None, _grad_allreduce),
    "vocab_logits": Style(
        nn.Linear, "out_features", lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    ),
}

REFUSED: dict[str, str] = {
    "sequence_parallel": "activations left sharded on the sequence, which only sequence-sharded "
    "neighbours can take (the other styles pass replicated activations)",
    "packed_colwise": "fused weights of mixture-of-experts layers (a strided shard)",
    "packed_rowwise": "fused weights of mixture-of-experts layers (a strided shard)",
    "moe_tp_experts": "mixture-of-experts layers",
    "moe_identity_expert": "mixture-of-experts layers",
    "mla_kv_a_proj": "multi-head latent attention (DeepSeek-V2 style)",
    "local_params": "bare parameters such as attention sinks, run as local tensors",
    "all_reduce": "a module whose output is partial by construction",
    "replicate": "per-tensor quantization scales",
    "ep_dispatch_experts": "expert parallelism (an ep_plan style)",
    "grouped_gemm": "expert parallelism (an ep_plan style)",
}


def lookup(name: str, where: str) -> Style:
    """The style called ``name`` (``where`` names the plan entry for the error), or a
    ValueError naming both when it is refused or unknown."""
    if name in REFUSED:
        raise ValueError(
            f"tensor parallel style {name!r} ({where}) is not supported: it is for {REFUSED[name]}; "
            f"supported styles: {', '.join(STYLES)}"
        )
    if name not in STYLES:
        raise ValueError(f"unknown tensor parallel style {name!r} ({where}); known: {', '.join(STYLES)}")
    return STYLES[name]
