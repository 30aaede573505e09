"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``) behind the adapter interface.

Conditioning: ``{"prompt_embeds": (B, L, joint_dim), "pooled_prompt_embeds": (B, pooled)}``.
The stream is (image tokens, text tokens). Every block's joint attention goes through the
kernel with the text tokens joining the image tokens; SD3.5's extra image-only attention
(``attn2``, dual-attention layers) goes through the kernel as plain self-attention.

The text stream is exact for every patch and band: text tokens are replicated on every
rank, and in each joint attention they attend to the whole image, never to a part of it.
Under Ulysses they take this rank's heads and their outputs are all-gathered over heads;
under Ring the text K/V is merged in locally once while the image K/V goes round; under
PipeFusion each patch carries its own copy of the text stream through the stages, and its
text queries attend to the full-image K/V buffer (fresh for the patches already done in
this step, one step stale for the rest) instead of being frozen after the first patch.
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
    JointKernelProcessor,
    KernelProcessor,
    check_attention_modules,
    embed_band,
    swapped_processors,
    unpatchify,
)


@dataclass
class SD3Step:
    temb: torch.Tensor  # (B, D) timestep + pooled text
    text: torch.Tensor  # (B, L, D) context-embedded prompt


class SD3Adapter:
    def __init__(self, model: nn.Module):
        config = model.config
        self.model = model
        self.patch_size = config.patch_size
        self.in_channels = config.in_channels
        self.out_channels = model.out_channels
        self.num_layers = len(model.transformer_blocks)
        self.num_heads = config.num_attention_heads
        self.hidden_size = model.inner_dim

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.transformer_blocks

    def check_size(self, height: int, width: int) -> None:
        check_patch_size(height, width, self.patch_size)
        limit = self.model.config.pos_embed_max_size * self.patch_size
        if height > limit or width > limit:
            raise ValueError(
                f"image size {height}x{width} exceeds this SD3 model's position table ({limit}x{limit})"
            )

    def prepare(self, model_time, cond: dict[str, torch.Tensor], height: int, width: int) -> SD3Step:
        text = cond["prompt_embeds"]
        t = torch.as_tensor(model_time, device=text.device).reshape(-1).expand(text.shape[0])
        temb = self.model.time_text_embed(t, cond["pooled_prompt_embeds"])
        return SD3Step(temb=temb, text=self.model.context_embedder(text))

    def embed(self, x_band: torch.Tensor, row_offset: int, height: int, width: int, ctx: SD3Step) -> Stream:
        image = embed_band(self.model.pos_embed, x_band, row_offset, height, width).contiguous()
        return (image, ctx.text)

    def block(self, index: int, stream: Stream, ctx: SD3Step, spans: list[tuple[int, int]]) -> Stream:
        text, image = self.model.transformer_blocks[index](
            hidden_states=stream[0], encoder_hidden_states=stream[1], temb=ctx.temb
        )
        return (image,) if text is None else (image, text)

    def head(self, stream: Stream, ctx: SD3Step, grid_cols: int) -> torch.Tensor:
        h = self.model.proj_out(self.model.norm_out(stream[0], ctx.temb))
        return unpatchify(h, grid_cols, self.patch_size, self.out_channels)

    def stream_shapes(self, batch: int, image_tokens: int, ctx: SD3Step) -> list[tuple[int, ...]]:
        return [(batch, image_tokens, self.hidden_size), (batch, ctx.text.shape[1], self.hidden_size)]

    def check_cond(self, cond: dict[str, torch.Tensor]) -> None:
        check_cond_keys("SD3", cond, ("prompt_embeds", "pooled_prompt_embeds"))

    def check_attention(self) -> None:
        from diffusers.models.attention_processor import JointAttnProcessor2_0

        layers = []
        for i, block in enumerate(self.model.transformer_blocks):
            layers.append((f"transformer_blocks.{i}.attn", block.attn, JointAttnProcessor2_0, False))
            if block.use_dual_attention:  # attn2 runs the same processor class, without text
                layers.append((f"transformer_blocks.{i}.attn2", block.attn2, JointAttnProcessor2_0, True))
        check_attention_modules(self.model, layers)

    def attention_kernel(self, kernel: AttentionKernel = serial_kernel):
        self.check_attention()
        pairs = []
        for i, block in enumerate(self.model.transformer_blocks):
            path = f"transformer_blocks.{i}"
            pairs.append((block.attn, JointKernelProcessor(i, kernel, f"{path}.attn")))
            if block.use_dual_attention:  # SD3.5: a second, image-only attention per block
                pairs.append((block.attn2, KernelProcessor(self.num_layers + i, kernel, f"{path}.attn2")))
        return swapped_processors(pairs)
