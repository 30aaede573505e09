"""Shared pieces of the diffusers adapters: attention processors around a Tessera kernel,
the check that each replaced layer is one they mirror, band patch-embedding and unpatchify.

Each Tessera processor mirrors one diffusers processor class (``AttnProcessor2_0``,
``JointAttnProcessor2_0``, ``FluxAttnProcessor``) with the attention core swapped for a
kernel. Before a swap, :func:`check_attention_modules` refuses by name every layer whose
computation that mirror would not reproduce: another processor class (IP-adapter, PAG,
classic ``AttnProcessor``, ...), fused q/k/v projections, a non-SDPA attention backend,
diffusers' own parallelism, diffusers hooks that change a layer's per-call computation
(caches, layer skip), and, where the kernel replaces image self-attention, cross-attention,
spatial or group norms.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tessera.diffusion.adapters.base import AttentionKernel


def refuse_call(path: str, feature: str) -> None:
    """A call the adapters never make (they pass no masks; checked again here, at the layer)."""
    raise ValueError(
        f"{path} was called with {feature}, which Tessera's parallel attention kernel does not "
        "take (it attends over every image token); run this model without Tessera"
    )


class KernelProcessor:
    """A diffusers attention processor for image self-attention around a Tessera kernel;
    mirrors ``AttnProcessor2_0`` (and ``JointAttnProcessor2_0`` called without text)."""

    def __init__(self, layer_index: int, kernel: AttentionKernel, path: str = "attention"):
        self.layer_index, self.kernel, self.path = layer_index, kernel, path

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs
    ):
        if encoder_hidden_states is not None:
            refuse_call(self.path, "encoder_hidden_states (cross-attention)")
        if attention_mask is not None:
            refuse_call(self.path, "an attention mask")
        # check_attention_modules refused these when the processor was installed
        assert attn.spatial_norm is None and attn.group_norm is None, "not a DiT attention layer"
        residual = hidden_states
        b = hidden_states.shape[0]
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = k.shape[-1] // attn.heads
        q, k, v = (t.view(b, -1, attn.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        out = self.kernel(self.layer_index, q, k, v)
        out = out.transpose(1, 2).reshape(b, -1, attn.heads * head_dim).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b = x.shape[0]
    return x.view(b, -1, heads, x.shape[-1] // heads).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).flatten(2)


class JointKernelProcessor:
    """SD3-style joint attention (image tokens + text tokens with their own projections)
    around a Tessera kernel; mirrors diffusers' JointAttnProcessor2_0."""

    def __init__(self, layer_index: int, kernel: AttentionKernel, path: str = "attention"):
        self.layer_index, self.kernel, self.path = layer_index, kernel, path

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if attention_mask is not None:
            refuse_call(self.path, "an attention mask")
        assert encoder_hidden_states is not None, "the SD3 adapter always passes the text stream"
        q, k, v = (_heads(f(hidden_states), attn.heads) for f in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q, k = attn.norm_q(q), attn.norm_k(k)
        text = encoder_hidden_states
        qt, kt, vt = (
            _heads(f(text), attn.heads) for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        )
        if attn.norm_added_q is not None:
            qt, kt = attn.norm_added_q(qt), attn.norm_added_k(kt)
        image_out, text_out = self.kernel(self.layer_index, q, k, v, (qt, kt, vt))
        image_out = attn.to_out[1](attn.to_out[0](_merge(image_out).to(q.dtype)))
        text_out = _merge(text_out).to(q.dtype)
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return image_out, text_out


# Attention backends (diffusers' set_attention_backend) that are torch's own SDPA: the same
# exact attention Tessera's kernels compute. Others (flash-attn, sage, flex, xformers, ...)
# are another implementation, some of them approximate.
_SDPA_BACKENDS = ("native", "_native_cudnn", "_native_efficient", "_native_flash", "_native_math")


def check_attention_modules(model: nn.Module, layers: list[tuple[str, nn.Module, type, bool]]) -> None:
    """Refuse, by name, the first layer whose computation the Tessera processor replacing it
    would not reproduce. ``layers``: (module path, attention module, the diffusers processor
    class the Tessera processor mirrors, whether the kernel takes image self-attention only)."""
    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError(
            f"{type(model).__name__} has diffusers' own parallelism enabled (enable_parallelism); "
            "Tessera splits the model itself: load it without"
        )
    _check_hooks(model)
    for path, attn, mirrored, image_only in layers:
        processor = attn.processor
        if getattr(attn, "fused_projections", False):
            raise ValueError(
                f"{path} has fused q/k/v projections (fuse_qkv_projections); Tessera's processors "
                "read to_q/to_k/to_v: call unfuse_qkv_projections() first"
            )
        if type(processor) is not mirrored:
            raise ValueError(
                f"{path} runs processor {type(processor).__name__}, which Tessera's parallel attention "
                f"does not reproduce (it replaces {mirrored.__name__} only): set that processor or "
                "run this model without Tessera"
            )
        backend = getattr(processor, "_attention_backend", None)
        name = getattr(backend, "value", backend)
        if name is not None and name not in _SDPA_BACKENDS:
            raise ValueError(
                f"{path} uses attention backend {name!r}, which Tessera's kernels (exact SDPA "
                "attention) would replace: call reset_attention_backend() first"
            )
        if image_only:
            _check_image_self_attention(path, attn)


# diffusers hooks that only move or cast weights around a layer's own computation
# (enable_group_offload, enable_layerwise_casting). Every other hook (caches, layer skip,
# guidance perturbations, context or tensor parallel) changes what a layer computes per call.
_WEIGHT_HOOKS = {
    "group_offloading",
    "layer_execution_tracker",
    "lazy_prefetch_group_offloading",
    "layerwise_casting",
    "peft_autocast_disable",
}


def _check_hooks(model: nn.Module) -> None:
    for path, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        for name in getattr(registry, "hooks", {}):
            if name not in _WEIGHT_HOOKS:
                raise ValueError(
                    f"{path or type(model).__name__} carries diffusers hook {name!r}, which would see Tessera's "
                    "band and patch calls instead of the model's: remove it (disable_cache()) first"
                )


def _check_image_self_attention(path: str, attn: nn.Module) -> None:
    for feature, present in (
        ("cross-attention (cross_attention_dim)", attn.is_cross_attention),
        ("a spatial norm (spatial_norm_dim)", attn.spatial_norm is not None),
        ("a group norm (norm_num_groups)", attn.group_norm is not None),
    ):
        if present:
            raise ValueError(
                f"{path} has {feature}; Tessera's parallel kernel replaces image self-attention "
                "only: run this model without Tessera"
            )


@contextmanager
def swapped_processors(pairs: list[tuple[nn.Module, object]]) -> Iterator[None]:
    """Give each attention module its processor for the duration; restore the originals."""
    originals = [attn.processor for attn, _ in pairs]
    try:
        for attn, processor in pairs:
            attn.processor = processor
        yield
    finally:
        for (attn, _), original in zip(pairs, originals, strict=True):
            attn.processor = original


def band_position_embedding(patch_embed: nn.Module, height: int, width: int) -> torch.Tensor:
    """The (1, tokens, D) position embedding diffusers' PatchEmbed adds for a full latent
    of ``height`` x ``width``, computed the way its forward does, so a band can take rows."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    p = patch_embed.patch_size
    if patch_embed.pos_embed_max_size:
        return patch_embed.cropped_pos_embed(height, width)
    rows, cols = height // p, width // p
    if (patch_embed.height, patch_embed.width) == (rows, cols):
        return patch_embed.pos_embed
    pos = get_2d_sincos_pos_embed(
        embed_dim=patch_embed.pos_embed.shape[-1],
        grid_size=(rows, cols),
        base_size=patch_embed.base_size,
        interpolation_scale=patch_embed.interpolation_scale,
        device=patch_embed.proj.weight.device,
        output_type="pt",
    )
    return pos.float().unsqueeze(0)


def embed_band(
    patch_embed: nn.Module, x_band: torch.Tensor, row_offset: int, height: int, width: int
) -> torch.Tensor:
    """PatchEmbed of a band of latent rows: the stride-p convolution is local to each
    patch, and the band takes its rows of the full image's position embedding."""
    tokens = patch_embed.proj(x_band).flatten(2).transpose(1, 2)
    if patch_embed.layer_norm:
        tokens = patch_embed.norm(tokens)
    if patch_embed.pos_embed is None:
        return tokens
    cols = width // patch_embed.patch_size
    start = row_offset * cols
    pos = band_position_embedding(patch_embed, height, width)[:, start : start + tokens.shape[1]]
    return (tokens + pos).to(tokens.dtype)


def unpatchify(tokens: torch.Tensor, grid_cols: int, patch_size: int, channels: int) -> torch.Tensor:
    b, n, _ = tokens.shape
    rows = n // grid_cols
    x = tokens.reshape(b, rows, grid_cols, patch_size, patch_size, channels)
    return torch.einsum("nhwpqc->nchpwq", x).reshape(b, channels, rows * patch_size, grid_cols * patch_size)
