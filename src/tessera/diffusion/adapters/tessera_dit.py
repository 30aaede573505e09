"""Tessera's own DiT behind the adapter interface."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tessera.diffusion.adapters.base import (
    AttentionKernel,
    Stream,
    check_cond_keys,
    check_patch_size,
    serial_kernel,
)
from tessera.models.dit import Attention, DiT


class KernelAttention(nn.Module):
    """Tessera DiT attention projections around a replaceable attention core."""

    def __init__(self, inner: Attention, layer_index: int, kernel: AttentionKernel):
        super().__init__()
        self.inner, self.layer_index, self.kernel = inner, layer_index, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.inner
        q, k, v = (inner.split_heads(f(x)) for f in (inner.to_q, inner.to_k, inner.to_v))
        out = self.kernel(self.layer_index, q, k, v)
        return inner.to_out(out.transpose(1, 2).flatten(2))


class TesseraDiTAdapter:
    """Tessera's own :class:`~tessera.models.dit.DiT`; conditioning ``{"labels": (B,)}``."""

    def __init__(self, model: DiT):
        self.model = model
        config = model.config
        self.patch_size = config.patch_size
        self.in_channels = config.in_channels
        self.num_layers = config.depth
        self.num_heads = config.num_heads
        self.hidden_size = config.hidden_size
        self.null_class = model.null_class

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.blocks

    def check_size(self, height: int, width: int) -> None:
        check_patch_size(height, width, self.patch_size)

    def prepare(
        self, model_time: float, cond: dict[str, torch.Tensor], height: int, width: int
    ) -> torch.Tensor:
        labels = cond["labels"]
        t = torch.full((labels.shape[0],), float(model_time), device=labels.device)
        return self.model.condition(t, labels)

    def embed(self, x_band: torch.Tensor, row_offset: int, height: int, width: int, ctx) -> Stream:
        return (self.model.embed(x_band, row_offset=row_offset),)

    def block(self, index: int, stream: Stream, ctx, spans: list[tuple[int, int]]) -> Stream:
        return (self.model.blocks[index](stream[0], ctx),)

    def head(self, stream: Stream, ctx, grid_cols: int) -> torch.Tensor:
        return self.model.head(stream[0], ctx, grid_cols)

    def stream_shapes(self, batch: int, image_tokens: int, ctx) -> list[tuple[int, ...]]:
        return [(batch, image_tokens, self.hidden_size)]

    def check_cond(self, cond: dict[str, torch.Tensor]) -> None:
        check_cond_keys("Tessera's DiT", cond, ("labels",))

    def check_attention(self) -> None:
        """KernelAttention reads the projections of Tessera's own Attention; another module
        in its place (a subclass too) may compute something else."""
        for index, block in enumerate(self.model.blocks):
            if type(block.attn) is not Attention:
                raise ValueError(
                    f"blocks.{index}.attn is a {type(block.attn).__name__}, not tessera.models.dit.Attention, "
                    "whose attention Tessera's parallel kernels replace: run this model without Tessera"
                )

    @contextmanager
    def attention_kernel(self, kernel: AttentionKernel = serial_kernel) -> Iterator[None]:
        self.check_attention()
        originals = [block.attn for block in self.model.blocks]
        try:
            for index, block in enumerate(self.model.blocks):
                block.attn = KernelAttention(originals[index], index, kernel)
            yield
        finally:
            for block, original in zip(self.model.blocks, originals, strict=True):
                block.attn = original
