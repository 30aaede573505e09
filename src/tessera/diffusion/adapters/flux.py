"""Flux (``FluxTransformer2DModel``) behind the adapter interface.

Flux takes *packed* latents: each 2x2 latent patch is one token, row-major over the
(H/2, W/2) grid. Samplers keep the unpacked (B, C, H, W) latent (the flow-matching step
is elementwise, so packing commutes with it); the adapter packs a band on the way in and
unpacks on the way out, so its patch size is 2 in latent pixels.

Conditioning: ``{"prompt_embeds": (B, L, joint_dim), "pooled_prompt_embeds": (B, pooled)}``
and, for guidance-distilled models (Flux-dev), ``{"guidance": (B,)}``. Positions are
rotary (RoPE) from (text, image) ids; a band's image tokens take their rows of the full
image's rotary table, text tokens the text's. Double-stream blocks attend jointly like
SD3 (see ``sd3.py`` for why the text stream is exact for every band and patch);
single-stream blocks run on [text, image] tokens, split here for the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tessera.diffusion.adapters.base import (
    AttentionKernel,
    Stream,
    check_cond_keys,
    check_patch_size,
    serial_kernel,
)
from tessera.diffusion.adapters.diffusers_common import (
    check_attention_modules,
    refuse_call,
    swapped_processors,
)

PACK = 2  # latent pixels per token side


def pack(x: torch.Tensor) -> torch.Tensor:
    b, c, h, w = x.shape
    x = x.view(b, c, h // PACK, PACK, w // PACK, PACK).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PACK) * (w // PACK), c * PACK * PACK)


def unpack(tokens: torch.Tensor, grid_cols: int, channels: int) -> torch.Tensor:
    b, n, _ = tokens.shape
    rows = n // grid_cols
    x = tokens.view(b, rows, grid_cols, channels, PACK, PACK).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels, rows * PACK, grid_cols * PACK)


def image_ids(rows: int, cols: int, device) -> torch.Tensor:
    """(rows*cols, 3) ids as the Flux pipeline makes them: (0, row, col)."""
    ids = torch.zeros(rows, cols, 3, device=device)
    ids[..., 1] = torch.arange(rows, device=device)[:, None]
    ids[..., 2] = torch.arange(cols, device=device)[None, :]
    return ids.reshape(rows * cols, 3)


@dataclass
class Rotary:
    """What the Flux processors get as ``image_rotary_emb``: text and this span's image."""

    text: tuple[torch.Tensor, torch.Tensor]
    image: tuple[torch.Tensor, torch.Tensor]


@dataclass
class FluxStep:
    temb: torch.Tensor
    text: torch.Tensor  # (B, L, D) context-embedded prompt
    text_rotary: tuple[torch.Tensor, torch.Tensor]
    image_rotary: tuple[torch.Tensor, torch.Tensor]  # the full image's table

    def rotary(self, spans: list[tuple[int, int]]) -> Rotary:
        image = tuple(torch.cat([t[a:b] for a, b in spans]) for t in self.image_rotary)
        return Rotary(text=self.text_rotary, image=image)


def _rope(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, table, sequence_dim=1)


def _qkv(attn, x: torch.Tensor, projections) -> list[torch.Tensor]:
    return [f(x).unflatten(-1, (-1, attn.head_dim)) for f in projections]


class FluxDoubleProcessor:
    """Double-stream joint attention (image and text with their own projections); mirrors
    ``FluxAttnProcessor``."""

    def __init__(self, layer_index: int, kernel: AttentionKernel, path: str = "attention"):
        self.layer_index, self.kernel, self.path = layer_index, kernel, path

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None
    ):
        if attention_mask is not None:
            refuse_call(self.path, "an attention mask")
        rotary: Rotary = image_rotary_emb
        q, k, v = _qkv(attn, hidden_states, (attn.to_q, attn.to_k, attn.to_v))
        qt, kt, vt = _qkv(attn, encoder_hidden_states, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        q, k = _rope(attn.norm_q(q), rotary.image), _rope(attn.norm_k(k), rotary.image)
        qt, kt = _rope(attn.norm_added_q(qt), rotary.text), _rope(attn.norm_added_k(kt), rotary.text)
        heads_first = [t.transpose(1, 2) for t in (q, k, v, qt, kt, vt)]
        image, text = self.kernel(self.layer_index, *heads_first[:3], tuple(heads_first[3:]))
        image = attn.to_out[1](attn.to_out[0](image.transpose(1, 2).flatten(2).to(q.dtype)))
        return image, attn.to_add_out(text.transpose(1, 2).flatten(2).to(q.dtype))


class FluxSingleProcessor:
    """Single-stream attention over [text, image] tokens (shared projections); mirrors
    ``FluxAttnProcessor``."""

    def __init__(self, layer_index: int, kernel: AttentionKernel, path: str = "attention"):
        self.layer_index, self.kernel, self.path = layer_index, kernel, path

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None
    ):
        if attention_mask is not None:
            refuse_call(self.path, "an attention mask")
        rotary: Rotary = image_rotary_emb
        length = rotary.text[0].shape[0]
        q, k, v = _qkv(attn, hidden_states, (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        text = [t[:, :length] for t in (q, k, v)]
        image = [t[:, length:] for t in (q, k, v)]
        text[0], text[1] = _rope(text[0], rotary.text), _rope(text[1], rotary.text)
        image[0], image[1] = _rope(image[0], rotary.image), _rope(image[1], rotary.image)
        image_out, text_out = self.kernel(
            self.layer_index, *(t.transpose(1, 2) for t in image), tuple(t.transpose(1, 2) for t in text)
        )
        out = torch.cat([text_out, image_out], dim=2).transpose(1, 2).flatten(2)
        return out.to(q.dtype)


class FluxAdapter:
    def __init__(self, model: nn.Module):
        config = model.config
        self.model = model
        self.patch_size = PACK
        self.in_channels = config.in_channels // (PACK * PACK)
        self.out_channels = (config.out_channels or config.in_channels) // (PACK * PACK)
        self.num_double = len(model.transformer_blocks)
        self.num_layers = self.num_double + len(model.single_transformer_blocks)
        self.num_heads = config.num_attention_heads
        self.hidden_size = model.inner_dim

    @property
    def blocks(self) -> nn.ModuleList:
        return nn.ModuleList([*self.model.transformer_blocks, *self.model.single_transformer_blocks])

    def check_size(self, height: int, width: int) -> None:
        check_patch_size(height, width, self.patch_size)

    def prepare(self, model_time, cond: dict[str, torch.Tensor], height: int, width: int) -> FluxStep:
        model = self.model
        text = cond["prompt_embeds"]
        batch, device = text.shape[0], text.device
        dtype = model.x_embedder.weight.dtype
        t = (torch.as_tensor(model_time, device=device).reshape(-1) / 1000).to(dtype).expand(batch) * 1000
        if model.config.guidance_embeds:
            temb = model.time_text_embed(t, cond["guidance"].to(dtype) * 1000, cond["pooled_prompt_embeds"])
        else:
            temb = model.time_text_embed(t, cond["pooled_prompt_embeds"])
        text_ids = torch.zeros(text.shape[1], 3, device=device)
        return FluxStep(
            temb=temb,
            text=model.context_embedder(text),
            text_rotary=model.pos_embed(text_ids),
            image_rotary=model.pos_embed(image_ids(height // PACK, width // PACK, device)),
        )

    def embed(self, x_band: torch.Tensor, row_offset: int, height: int, width: int, ctx: FluxStep) -> Stream:
        return (self.model.x_embedder(pack(x_band)), ctx.text)

    def block(self, index: int, stream: Stream, ctx: FluxStep, spans: list[tuple[int, int]]) -> Stream:
        blocks = (
            self.model.transformer_blocks if index < self.num_double else self.model.single_transformer_blocks
        )
        block = blocks[index if index < self.num_double else index - self.num_double]
        text, image = block(
            hidden_states=stream[0],
            encoder_hidden_states=stream[1],
            temb=ctx.temb,
            image_rotary_emb=ctx.rotary(spans),
        )
        return (image, text)

    def head(self, stream: Stream, ctx: FluxStep, grid_cols: int) -> torch.Tensor:
        tokens = self.model.proj_out(self.model.norm_out(stream[0], ctx.temb))
        return unpack(tokens, grid_cols, self.out_channels)

    def stream_shapes(self, batch: int, image_tokens: int, ctx: FluxStep) -> list[tuple[int, ...]]:
        return [(batch, image_tokens, self.hidden_size), (batch, ctx.text.shape[1], self.hidden_size)]

    def check_cond(self, cond: dict[str, torch.Tensor]) -> None:
        text = ("prompt_embeds", "pooled_prompt_embeds")
        if self.model.config.guidance_embeds:
            check_cond_keys("Flux with a guidance embedding", cond, (*text, "guidance"))
        else:
            check_cond_keys("Flux without a guidance embedding (guidance_embeds=False)", cond, text)

    def _layers(self) -> list[tuple[str, nn.Module]]:
        model = self.model
        return [(f"transformer_blocks.{i}.attn", b.attn) for i, b in enumerate(model.transformer_blocks)] + [
            (f"single_transformer_blocks.{i}.attn", b.attn)
            for i, b in enumerate(model.single_transformer_blocks)
        ]

    def check_attention(self) -> None:
        from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

        check_attention_modules(
            self.model, [(path, attn, FluxAttnProcessor, False) for path, attn in self._layers()]
        )

    def attention_kernel(self, kernel: AttentionKernel = serial_kernel):
        self.check_attention()
        pairs = []
        for i, (path, attn) in enumerate(self._layers()):
            processor = FluxDoubleProcessor if i < self.num_double else FluxSingleProcessor
            pairs.append((attn, processor(i, kernel, path)))
        return swapped_processors(pairs)
