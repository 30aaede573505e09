"""Which diffusers transformer classes Tessera's parallel methods support."""

from __future__ import annotations

from torch import nn


def diffusers_adapter_for(model: nn.Module):
    """An adapter for a supported diffusers transformer, else None."""
    try:
        import diffusers
    except ImportError:  # diffusers is optional for Tessera's own models
        return None
    from tessera.compat import check_versions
    from tessera.diffusion.adapters.flux import FluxAdapter
    from tessera.diffusion.adapters.ltx import LTXAdapter
    from tessera.diffusion.adapters.pixart import PixArtAdapter
    from tessera.diffusion.adapters.sd3 import SD3Adapter
    from tessera.diffusion.adapters.wan import WanAdapter

    for cls, adapter in (
        (diffusers.PixArtTransformer2DModel, PixArtAdapter),
        (diffusers.SD3Transformer2DModel, SD3Adapter),
        (diffusers.FluxTransformer2DModel, FluxAdapter),
        (diffusers.WanTransformer3DModel, WanAdapter),
        (diffusers.LTXVideoTransformer3DModel, LTXAdapter),
    ):
        if isinstance(model, cls):
            # the adapters follow the class's internals: a release they were not written for is refused
            check_versions("diffusers")
            return adapter(model)
    return None
