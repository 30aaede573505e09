"""What the parallel samplers need from a diffusion transformer, behind one interface.

A sampler never calls a model's ``forward``: it embeds a band of latent rows, runs blocks
one at a time on any slice of the token sequence, and applies the output head. Every
operation of a DiT block except attention is token-local, so splitting tokens is exact as
long as attention sees the right keys and values; ``attention_kernel`` swaps the
attention core of every layer (projections stay the model's own) for the duration of a
``with`` block, which is how each parallel method plugs in. The model itself is never
edited in place beyond that swap, and is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tessera.diffusion.attention import attention
from tessera.models.dit import Attention, DiT

# kernel(layer_index, q, k, v) -> attention output, all (B, H, tokens, head_dim)
AttentionKernel = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class KernelAttention(nn.Module):
    """The model's attention projections around a replaceable attention core."""

    def __init__(self, inner: Attention, layer_index: int, kernel: AttentionKernel):
        super().__init__()
        self.inner, self.layer_index, self.kernel = inner, layer_index, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.inner
        q, k, v = (inner.split_heads(f(x)) for f in (inner.to_q, inner.to_k, inner.to_v))
        out = self.kernel(self.layer_index, q, k, v)
        return inner.to_out(out.transpose(1, 2).flatten(2))


def _serial_kernel(layer: int, q, k, v):
    return attention(q, k, v)


class DiTAdapter:
    """Tessera's own :class:`~tessera.models.dit.DiT` seen by the parallel samplers."""

    def __init__(self, model: DiT):
        if not isinstance(model, DiT):
            raise ValueError(
                f"no parallel method supports {type(model).__name__}; supported: tessera DiT "
                "(diffusers transformers go through tessera.diffusion.diffusers_adapter)"
            )
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
        p = self.patch_size
        if height % p or width % p:
            raise ValueError(f"image size {height}x{width} is not divisible by the patch size {p}")

    def condition(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model.condition(t, y)

    def embed(self, x_band: torch.Tensor, row_offset: int) -> torch.Tensor:
        return self.model.embed(x_band, row_offset=row_offset)

    def block(self, index: int, tokens: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.model.blocks[index](tokens, c)

    def head(self, tokens: torch.Tensor, c: torch.Tensor, grid_cols: int) -> torch.Tensor:
        return self.model.head(tokens, c, grid_cols)

    @contextmanager
    def attention_kernel(self, kernel: AttentionKernel = _serial_kernel) -> Iterator[None]:
        originals = [block.attn for block in self.model.blocks]
        try:
            for index, block in enumerate(self.model.blocks):
                block.attn = KernelAttention(originals[index], index, kernel)
            yield
        finally:
            for block, original in zip(self.model.blocks, originals, strict=True):
                block.attn = original
