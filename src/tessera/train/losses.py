"""Losses the recipes, benchmarks and tests share."""

from __future__ import annotations

import torch
from torch import nn


def causal_lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a HuggingFace causal LM on ``tokens`` (B, S). Works
    on vocabulary-sharded logits (a DTensor) under ``loss_parallel``."""
    logits = model(input_ids=tokens).logits
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
