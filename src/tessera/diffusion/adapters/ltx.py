"""LTX-Video (``LTXVideoTransformer3DModel``) behind the adapter interface.

As for Wan (``adapters/wan.py``), the video latent (B, C, F, H, W) is the samplers' image
(B, C, F*H, W): frame x row rows, frame-major, the order of LTX's tokens (one token per
latent pixel: patch 1 x 1 x 1). A band's tokens are projected by ``proj_in`` (token-local)
and take their part of the whole video's rotary table (LTX computes it from (frame, row,
column) coordinates scaled by ``rope_interpolation_scale``); each block's ``attn1`` goes
through the parallel kernel (mirrors ``LTXVideoAttnProcessor``), ``attn2`` (cross-attention
to the prompt, with its padding mask as an additive bias, as the model's forward makes it)
runs as the model's.

Conditioning: ``{"prompt_embeds", "prompt_attention_mask", "latent_frames",
"rope_interpolation_scale": (B, 3)}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tessera.diffusion.adapters.base import AttentionKernel, Stream, check_cond_keys, serial_kernel
from tessera.diffusion.adapters.diffusers_common import (
    check_attention_modules,
    refuse_call,
    swapped_processors,
)


class LTXKernelProcessor:
    """LTX self-attention around a Tessera kernel; mirrors ``LTXVideoAttnProcessor``."""

    def __init__(self, layer_index: int, kernel: AttentionKernel, path: str = "attention"):
        self.layer_index, self.kernel, self.path = layer_index, kernel, path

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None
    ):
        from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

        if encoder_hidden_states is not None:
            refuse_call(self.path, "encoder_hidden_states (cross-attention)")
        if attention_mask is not None:
            refuse_call(self.path, "an attention mask")
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q, k = apply_rotary_emb(q, image_rotary_emb), apply_rotary_emb(k, image_rotary_emb)
        q, k, v = (t.unflatten(2, (attn.heads, -1)).transpose(1, 2) for t in (q, k, v))
        out = self.kernel(self.layer_index, q, k, v)
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


@dataclass
class LTXStep:
    temb: torch.Tensor  # (B, 1, 6*D)
    embedded: torch.Tensor  # (B, 1, D)
    text: torch.Tensor  # (B, L, D)
    text_bias: torch.Tensor | None  # (B, 1, L)
    rotary: tuple[torch.Tensor, torch.Tensor]  # the whole video's (1, tokens, D)

    def rotary_of(self, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.cat([t[:, a:b] for a, b in spans], dim=1) for t in self.rotary)


class LTXAdapter:
    def __init__(self, model: nn.Module):
        config = model.config
        if config.patch_size != 1 or config.patch_size_t != 1:
            raise ValueError(
                f"LTX patch size {config.patch_size} x {config.patch_size_t} (time): Tessera splits LTX's "
                "frame x row tokens with patch 1 x 1 (LTX-Video 0.9) only"
            )
        self.model = model
        self.patch_size = 1
        self.in_channels = config.in_channels
        self.out_channels = config.out_channels
        self.num_layers = len(model.transformer_blocks)
        self.num_heads = config.num_attention_heads
        self.hidden_size = (
            model.inner_dim if hasattr(model, "inner_dim") else self.num_heads * config.attention_head_dim
        )

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.transformer_blocks

    def check_size(self, height: int, width: int) -> None:
        pass  # one token per latent pixel

    def prepare(self, model_time, cond: dict[str, torch.Tensor], height: int, width: int) -> LTXStep:
        model = self.model
        text, mask = cond["prompt_embeds"], cond.get("prompt_attention_mask")
        batch, device, dtype = text.shape[0], text.device, model.proj_in.weight.dtype
        frames = int(cond["latent_frames"][0])
        if height % frames:
            raise ValueError(f"{height} latent rows are not {frames} frames of equal height")
        scale = tuple(cond["rope_interpolation_scale"][0].tolist())  # python floats, as the pipeline passes
        probe = torch.empty(1, 0, device=device)  # rope reads the batch size and device
        rotary = model.rope(probe, frames, height // frames, width, scale)
        t = torch.as_tensor(model_time, device=device).reshape(-1).expand(batch)
        temb, embedded = model.time_embed(t.flatten(), batch_size=batch, hidden_dtype=dtype)
        bias = None if mask is None else ((1 - mask.to(dtype)) * -10000.0).unsqueeze(1)
        return LTXStep(
            temb=temb.view(batch, -1, temb.size(-1)),
            embedded=embedded.view(batch, -1, embedded.size(-1)),
            text=model.caption_projection(text).view(batch, -1, self.hidden_size),
            text_bias=bias,
            rotary=rotary,
        )

    def embed(self, x_band: torch.Tensor, row_offset: int, height: int, width: int, ctx: LTXStep) -> Stream:
        b, c = x_band.shape[:2]
        return (self.model.proj_in(x_band.permute(0, 2, 3, 1).reshape(b, -1, c)),)

    def block(self, index: int, stream: Stream, ctx: LTXStep, spans: list[tuple[int, int]]) -> Stream:
        out = self.model.transformer_blocks[index](
            hidden_states=stream[0],
            encoder_hidden_states=ctx.text,
            temb=ctx.temb,
            image_rotary_emb=ctx.rotary_of(spans),
            encoder_attention_mask=ctx.text_bias,
        )
        return (out,)

    def head(self, stream: Stream, ctx: LTXStep, grid_cols: int) -> torch.Tensor:
        model = self.model
        values = model.scale_shift_table[None, None] + ctx.embedded[:, :, None]
        shift, scale = values[:, :, 0], values[:, :, 1]
        tokens = model.proj_out(model.norm_out(stream[0]) * (1 + scale) + shift)
        b, n, c = tokens.shape
        return tokens.reshape(b, n // grid_cols, grid_cols, c).permute(0, 3, 1, 2)

    def stream_shapes(self, batch: int, image_tokens: int, ctx) -> list[tuple[int, ...]]:
        return [(batch, image_tokens, self.hidden_size)]

    def check_cond(self, cond: dict[str, torch.Tensor]) -> None:
        check_cond_keys(
            "LTX",
            cond,
            ("prompt_embeds", "latent_frames", "rope_interpolation_scale"),
            ("prompt_attention_mask",),
        )

    def _layers(self) -> list[tuple[str, nn.Module]]:
        return [
            (f"transformer_blocks.{i}.attn1", b.attn1) for i, b in enumerate(self.model.transformer_blocks)
        ]

    def check_attention(self) -> None:
        from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor

        check_attention_modules(self.model, [(p, a, LTXVideoAttnProcessor, False) for p, a in self._layers()])

    def attention_kernel(self, kernel: AttentionKernel = serial_kernel):
        self.check_attention()
        return swapped_processors(
            [(attn, LTXKernelProcessor(i, kernel, path)) for i, (path, attn) in enumerate(self._layers())]
        )
