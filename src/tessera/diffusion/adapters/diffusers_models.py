"""Which diffusers transformer classes Tessera's parallel methods support."""

from __future__ import annotations

from torch import nn


def diffusers_adapter_for(model: nn.Module):
    """An adapter for a supported diffusers transformer, else None."""
    try:
        import diffusers
    except ImportError:  # diffusers is optional for Tessera's own models
        return None
    from tessera.diffusion.adapters.flux import FluxAdapter
    from tessera.diffusion.adapters.pixart import PixArtAdapter
    from tessera.diffusion.adapters.sd3 import SD3Adapter

    if isinstance(model, diffusers.PixArtTransformer2DModel):
        return PixArtAdapter(model)
    if isinstance(model, diffusers.SD3Transformer2DModel):
        return SD3Adapter(model)
    if isinstance(model, diffusers.FluxTransformer2DModel):
        return FluxAdapter(model)
    return None
