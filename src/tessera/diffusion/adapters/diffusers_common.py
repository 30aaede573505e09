"""Shared pieces of the diffusers adapters: attention processors around a Tessera kernel,
band patch-embedding and unpatchify."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tessera.diffusion.adapters.base import AttentionKernel


class KernelProcessor:
    """A diffusers attention processor for image self-attention around a Tessera kernel."""

    def __init__(self, layer_index: int, kernel: AttentionKernel):
        self.layer_index, self.kernel = layer_index, kernel

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs
    ):
        assert encoder_hidden_states is None and attention_mask is None, "image self-attention only"
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


@contextmanager
def swapped_processors(attentions: list[nn.Module], kernel: AttentionKernel) -> Iterator[None]:
    originals = [a.processor for a in attentions]
    try:
        for index, a in enumerate(attentions):
            a.processor = KernelProcessor(index, kernel)
        yield
    finally:
        for a, original in zip(attentions, originals, strict=True):
            a.processor = original


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
