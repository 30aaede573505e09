"""Adapters for HuggingFace diffusers transformers (filled in per model family)."""

from __future__ import annotations

from torch import nn


def diffusers_adapter_for(model: nn.Module):
    return None
