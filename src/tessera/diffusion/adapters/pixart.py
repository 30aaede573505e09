"""Adapters for HuggingFace diffusers transformers: the model classes are used as they
are (a user's ``from_pretrained`` model), never copied; only their self-attention
processors are swapped for the duration of a parallel run.

PixArt (``PixArtTransformer2DModel``): conditioning ``{"prompt_embeds", "prompt_attention_mask"}``
plus, for the 1024-px models, ``{"resolution", "aspect_ratio"}``; each block's ``attn1``
(image self-attention) goes through the parallel kernel, its cross-attention ``attn2``
to the text is token-local and runs unchanged.
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
    KernelProcessor,
    check_attention_modules,
    embed_band,
    swapped_processors,
    unpatchify,
)


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

    def prepare(self, model_time, cond: dict[str, torch.Tensor], height: int, width: int) -> PixArtStep:
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

    def block(self, index: int, stream: Stream, ctx: PixArtStep, spans: list[tuple[int, int]]) -> Stream:
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

    def check_cond(self, cond: dict[str, torch.Tensor]) -> None:
        # The 1024-px models (use_additional_conditions) also take the image size; the others ignore it.
        sizes = ("resolution", "aspect_ratio") if self.model.use_additional_conditions else ()
        check_cond_keys("PixArt", cond, ("prompt_embeds", *sizes), ("prompt_attention_mask",))

    def check_attention(self) -> None:
        from diffusers.models.attention_processor import AttnProcessor2_0

        layers = [
            (f"transformer_blocks.{i}.attn1", b.attn1, AttnProcessor2_0, True)
            for i, b in enumerate(self.model.transformer_blocks)
        ]
        check_attention_modules(self.model, layers)

    def attention_kernel(self, kernel: AttentionKernel = serial_kernel):
        self.check_attention()
        blocks = self.model.transformer_blocks
        return swapped_processors(
            [
                (b.attn1, KernelProcessor(i, kernel, f"transformer_blocks.{i}.attn1"))
                for i, b in enumerate(blocks)
            ]
        )
