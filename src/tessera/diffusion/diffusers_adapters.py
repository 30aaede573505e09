"""Adapters for HuggingFace diffusers transformers: the model classes are used as they
are (a user's ``from_pretrained`` model), never copied; only their self-attention
processors are swapped for the duration of a parallel run.

PixArt (``PixArtTransformer2DModel``): conditioning ``{"prompt_embeds", "prompt_attention_mask"}``
plus, for the 1024-px models, ``{"resolution", "aspect_ratio"}``; each block's ``attn1``
(image self-attention) goes through the parallel kernel, its cross-attention ``attn2``
to the text is token-local and runs unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tessera.diffusion.adapter import AttentionKernel, Stream, check_patch_size, serial_kernel


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


@dataclass
class PixArtStep:
    timestep: torch.Tensor  # adaLN-single modulation (B, 6*D)
    embedded: torch.Tensor  # embedded timestep (B, D), for the output modulation
    text: torch.Tensor  # projected caption (B, L, D)
    text_mask: torch.Tensor | None  # additive bias (B, 1, L)


class PixArtAdapter:
    def __init__(self, model: nn.Module):
        config = model.config
        self.model = model
        self.patch_size = config.patch_size
        self.in_channels = config.in_channels
        self.out_channels = model.out_channels
        self.num_layers = len(model.transformer_blocks)
        self.num_heads = config.num_attention_heads
        self.hidden_size = config.num_attention_heads * config.attention_head_dim

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.transformer_blocks

    def check_size(self, height: int, width: int) -> None:
        check_patch_size(height, width, self.patch_size)

    def prepare(self, model_time, cond: dict[str, torch.Tensor]) -> PixArtStep:
        model = self.model
        text = cond["prompt_embeds"]
        batch, dtype = text.shape[0], model.pos_embed.proj.weight.dtype
        t = torch.as_tensor(model_time, device=text.device).reshape(-1).expand(batch)
        added = {"resolution": cond.get("resolution"), "aspect_ratio": cond.get("aspect_ratio")}
        timestep, embedded = model.adaln_single(t, added, batch_size=batch, hidden_dtype=dtype)
        if model.caption_projection is not None:
            text = model.caption_projection(text).view(batch, -1, self.hidden_size)
        mask = cond.get("prompt_attention_mask")
        bias = None if mask is None else ((1 - mask.to(dtype)) * -10000.0).unsqueeze(1)
        return PixArtStep(timestep=timestep, embedded=embedded, text=text, text_mask=bias)

    def embed(
        self, x_band: torch.Tensor, row_offset: int, height: int, width: int, ctx: PixArtStep
    ) -> Stream:
        return (embed_band(self.model.pos_embed, x_band, row_offset, height, width),)

    def block(self, index: int, stream: Stream, ctx: PixArtStep) -> Stream:
        out = self.model.transformer_blocks[index](
            stream[0],
            attention_mask=None,
            encoder_hidden_states=ctx.text,
            encoder_attention_mask=ctx.text_mask,
            timestep=ctx.timestep,
            cross_attention_kwargs=None,
            class_labels=None,
        )
        return (out,)

    def head(self, stream: Stream, ctx: PixArtStep, grid_cols: int) -> torch.Tensor:
        model = self.model
        shift, scale = (model.scale_shift_table[None] + ctx.embedded[:, None]).chunk(2, dim=1)
        h = model.norm_out(stream[0]) * (1 + scale) + shift
        out = unpatchify(model.proj_out(h), grid_cols, self.patch_size, self.out_channels)
        # Learned-sigma models predict (noise, variance); samplers use the noise, as the pipeline does.
        return out[:, : self.in_channels] if self.out_channels == 2 * self.in_channels else out

    def stream_shapes(self, batch: int, image_tokens: int, ctx) -> list[tuple[int, ...]]:
        return [(batch, image_tokens, self.hidden_size)]

    def attention_kernel(self, kernel: AttentionKernel = serial_kernel):
        return swapped_processors([b.attn1 for b in self.model.transformer_blocks], kernel)


def diffusers_adapter_for(model: nn.Module):
    """An adapter for a supported diffusers transformer, else None."""
    try:
        from diffusers import PixArtTransformer2DModel
    except ImportError:  # diffusers is optional for Tessera's own models
        return None
    if isinstance(model, PixArtTransformer2DModel):
        return PixArtAdapter(model)
    return None
