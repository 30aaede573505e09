"""A model's transformer blocks, and activation checkpointing applied to each of them.

The blocks are the modules HuggingFace itself checkpoints (``GradientCheckpointingLayer``:
every decoder/encoder layer of a transformers model); for other models, the members of
each outermost ``nn.ModuleList`` whose members are all of one class (a DiT's
``blocks``). ``boost`` uses them for ``Plan(activation_checkpointing=True)`` and for
``Plan(block_chunks=True)``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost repeated blocks of ``model`` in module order (see the module doc)."""
    layer_class = _hf_checkpointing_layer()
    if layer_class is not None:
        found = _outermost(model, lambda m: isinstance(m, layer_class))
        if found:
            return found
    lists = _outermost(
        model,
        lambda m: isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1,
    )
    return [block for lst in lists for block in lst if any(True for _ in block.parameters())]


def _hf_checkpointing_layer():
    if "transformers" not in sys.modules:  # a model that is not a transformers one
        return None
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def _outermost(model: nn.Module, wanted: Callable[[nn.Module], bool]) -> list[nn.Module]:
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if module is not model and wanted(module):
            out.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return out


def blocks_or_error(model: nn.Module, setting: str) -> list[nn.Module]:
    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(
            f"Plan({setting}=True) needs transformer blocks, but {type(model).__name__} has none "
            "(no transformers GradientCheckpointingLayer and no nn.ModuleList of repeated layers)"
        )
    return blocks


def checkpoint_blocks(model: nn.Module, blocks: list[nn.Module], context_fn: Callable | None = None) -> None:
    """Each block's forward runs under non-reentrant ``torch.utils.checkpoint``: its
    activations are dropped after forward and recomputed in backward. ``context_fn`` (as
    ``checkpoint`` takes it) gives the contexts of the forward and of the recomputation:
    ZeRO-3 uses it to keep re-gathered parameters until their gradients are reduced.

    A transformers model does it its own way (``activation_checkpointing_enable``: the same
    blocks, with the KV cache turned off so the recomputation does not write it twice); other
    models get each block's ``forward`` wrapped (``forward``, not ``__call__``: the hooks of
    the block itself stay outside)."""
    kwargs = {"use_reentrant": False, **({"context_fn": context_fn} if context_fn is not None else {})}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and getattr(model, "supports_gradient_checkpointing", False):
        enable(activation_checkpointing_kwargs=kwargs)
        return
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, _block=block, **fkwargs):
            if not (torch.is_grad_enabled() and _block.training):
                return _inner(*args, **fkwargs)
            return checkpoint(_inner, *args, **kwargs, **fkwargs)

        block.forward = forward
