"""Wan 2.1 text-to-video (``WanTransformer3DModel``) behind the adapter interface.

A video latent (B, C, F, H, W) is handed to the samplers as the image (B, C, F*H, W): its
rows are *frame x row* rows, frame-major, which is the order of Wan's tokens (frame, row,
column). Bands and PipeFusion patches of token rows are then contiguous runs of the video's
tokens, spanning frames where they must, and every sampler runs unchanged. The patch
embedding (a Conv3d of kernel (1, 2, 2)) is local to each patch, so a band is embedded as
one frame of its rows; rotary positions are (frame, row, column) and a band takes its
tokens of the whole video's table (as Flux's image tokens do). Each block's ``attn1``
(self-attention over every token of the video) goes through the parallel kernel; ``attn2``
(cross-attention to the prompt) is token-local and runs as the model's.

Conditioning: ``{"prompt_embeds": (B, L, text_dim), "latent_frames": (B,) int}`` — the
latent frame count, which the (F*H, W) view cannot tell.
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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on (B, tokens, heads, d), as ``WanAttnProcessor`` applies it
    (interleaved pairs)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanKernelProcessor:
    """Wan self-attention around a Tessera kernel; mirrors ``WanAttnProcessor`` (text-to-
    video: no image key/value projections)."""

    def __init__(self, layer_index: int, kernel: AttentionKernel, path: str = "attention"):
        self.layer_index, self.kernel, self.path = layer_index, kernel, path

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None:
            refuse_call(self.path, "encoder_hidden_states (cross-attention)")
        if attention_mask is not None:
            refuse_call(self.path, "an attention mask")
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        out = self.kernel(self.layer_index, *(t.transpose(1, 2) for t in (q, k, v)))
        out = out.transpose(1, 2).flatten(2).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


@dataclass
class WanStep:
    temb: torch.Tensor  # (B, D): the output modulation's
    modulation: torch.Tensor  # (B, 6, D): every block's
    text: torch.Tensor  # (B, L, D) embedded prompt
    rotary: tuple[torch.Tensor, torch.Tensor]  # the whole video's (1, tokens, 1, d) tables

    def rotary_of(self, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.cat([t[:, a:b] for a, b in spans], dim=1) for t in self.rotary)


class WanAdapter:
    def __init__(self, model: nn.Module):
        config = model.config
        patch = tuple(config.patch_size)
        if patch[0] != 1 or patch[1] != patch[2]:
            raise ValueError(
                f"Wan patch size {patch}: Tessera splits frame x row tokens with patches (1, p, p) only"
            )
        if config.image_dim is not None or config.added_kv_proj_dim is not None:
            raise ValueError(
                "WanTransformer3DModel with image conditioning (image_dim / added_kv_proj_dim: Wan "
                "image-to-video) is not supported; text-to-video models are"
            )
        self.model = model
        self.patch_size = patch[1]
        self.in_channels = config.in_channels
        self.out_channels = config.out_channels or config.in_channels
        self.num_layers = len(model.blocks)
        self.num_heads = config.num_attention_heads
        self.hidden_size = config.num_attention_heads * config.attention_head_dim

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.blocks

    def check_size(self, height: int, width: int) -> None:
        check_patch_size(height, width, self.patch_size)

    def prepare(self, model_time, cond: dict[str, torch.Tensor], height: int, width: int) -> WanStep:
        model = self.model
        text = cond["prompt_embeds"]
        batch, device = text.shape[0], text.device
        frames = int(cond["latent_frames"][0])
        if height % frames:
            raise ValueError(f"{height} latent rows are not {frames} frames of equal height")
        t = torch.as_tensor(model_time, device=device).reshape(-1).expand(batch)
        temb, modulation, text, _ = model.condition_embedder(t, text, None, timestep_seq_len=None)
        video = torch.empty(1, 1, frames, height // frames, width, device="meta")  # rope reads the shape
        return WanStep(
            temb=temb, modulation=modulation.unflatten(1, (6, -1)), text=text, rotary=model.rope(video)
        )

    def embed(self, x_band: torch.Tensor, row_offset: int, height: int, width: int, ctx: WanStep) -> Stream:
        tokens = self.model.patch_embedding(x_band.unsqueeze(2))  # one "frame" of frame x row rows
        return (tokens.flatten(2).transpose(1, 2).contiguous(),)

    def block(self, index: int, stream: Stream, ctx: WanStep, spans: list[tuple[int, int]]) -> Stream:
        out = self.model.blocks[index](stream[0], ctx.text, ctx.modulation, ctx.rotary_of(spans))
        return (out,)

    def head(self, stream: Stream, ctx: WanStep, grid_cols: int) -> torch.Tensor:
        model, x = self.model, stream[0]
        shift, scale = (model.scale_shift_table + ctx.temb.unsqueeze(1)).chunk(2, dim=1)
        x = (model.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        tokens = model.proj_out(x)  # (B, n, p*p*C), ordered (frame patch 1, row, column, channel)
        b, n, _ = tokens.shape
        p, c = self.patch_size, self.out_channels
        rows = n // grid_cols
        out = tokens.reshape(b, rows, grid_cols, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(b, c, rows * p, grid_cols * p)

    def stream_shapes(self, batch: int, image_tokens: int, ctx) -> list[tuple[int, ...]]:
        return [(batch, image_tokens, self.hidden_size)]

    def check_cond(self, cond: dict[str, torch.Tensor]) -> None:
        check_cond_keys("Wan", cond, ("prompt_embeds", "latent_frames"))

    def _layers(self) -> list[tuple[str, nn.Module]]:
        return [(f"blocks.{i}.attn1", b.attn1) for i, b in enumerate(self.model.blocks)]

    def check_attention(self) -> None:
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        layers = self._layers()
        check_attention_modules(self.model, [(path, attn, WanAttnProcessor, False) for path, attn in layers])
        for path, attn in layers:
            if attn.is_cross_attention or attn.add_k_proj is not None:
                raise ValueError(
                    f"{path} has cross-attention or image key/value projections; Tessera's parallel "
                    "kernel replaces video self-attention only: run this model without Tessera"
                )

    def attention_kernel(self, kernel: AttentionKernel = serial_kernel):
        self.check_attention()
        return swapped_processors(
            [(attn, WanKernelProcessor(i, kernel, path)) for i, (path, attn) in enumerate(self._layers())]
        )
