"""Adapters: what the parallel samplers need from each supported transformer family."""

from __future__ import annotations

from torch import nn

from tessera.diffusion.adapters.base import Adapter, AttentionKernel, Stream, serial_kernel
from tessera.diffusion.adapters.tessera_dit import TesseraDiTAdapter
from tessera.models.dit import DiT

__all__ = ["Adapter", "AttentionKernel", "Stream", "TesseraDiTAdapter", "adapter_for", "serial_kernel"]


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of a supported model class; a ValueError naming the class otherwise."""
    if isinstance(model, DiT):
        return TesseraDiTAdapter(model)
    from tessera.diffusion.adapters.diffusers_models import diffusers_adapter_for

    adapter = diffusers_adapter_for(model)
    if adapter is None:
        raise ValueError(
            f"no parallel method supports {type(model).__name__}; supported: tessera DiT, "
            "diffusers PixArtTransformer2DModel, SD3Transformer2DModel, FluxTransformer2DModel, "
            "WanTransformer3DModel, LTXVideoTransformer3DModel"
        )
    return adapter
