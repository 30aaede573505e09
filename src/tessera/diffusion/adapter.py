"""What the parallel samplers need from a diffusion transformer, behind one interface.

A sampler never calls a model's ``forward``: it prepares the step's conditioning, embeds a
band of latent rows into a *stream* (a tuple of tensors: the image tokens, plus the text
tokens for joint-attention models), runs blocks one at a time on the stream, and applies
the output head to the image tokens. Every operation of a DiT block except attention over
the image tokens is token-local, so splitting image tokens is exact as long as attention
sees the right keys and values; ``attention_kernel`` swaps the attention core of every
self-attention layer (the projections stay the model's own) for the duration of a
``with`` block, which is how each parallel method plugs in. The model is restored after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from tessera.diffusion.attention import attention
from tessera.models.dit import Attention, DiT

# kernel(layer_index, q, k, v) -> attention output, all (B, H, tokens, head_dim)
AttentionKernel = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Stream = tuple[torch.Tensor, ...]


def serial_kernel(layer: int, q, k, v):
    return attention(q, k, v)


class Adapter(Protocol):
    model: nn.Module
    blocks: nn.ModuleList  # the transformer layers, in order
    patch_size: int
    in_channels: int
    num_layers: int
    num_heads: int
    hidden_size: int

    def check_size(self, height: int, width: int) -> None: ...
    def prepare(self, model_time: Any, cond: dict[str, torch.Tensor]) -> Any: ...
    def embed(self, x_band: torch.Tensor, row_offset: int, height: int, width: int, ctx: Any) -> Stream: ...
    def block(self, index: int, stream: Stream, ctx: Any) -> Stream: ...
    def head(self, stream: Stream, ctx: Any, grid_cols: int) -> torch.Tensor: ...
    def stream_shapes(self, batch: int, image_tokens: int, ctx: Any) -> list[tuple[int, ...]]: ...
    def attention_kernel(self, kernel: AttentionKernel) -> Any: ...


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


def check_patch_size(height: int, width: int, patch_size: int) -> None:
    if height % patch_size or width % patch_size:
        raise ValueError(f"image size {height}x{width} is not divisible by the patch size {patch_size}")


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

    def prepare(self, model_time: float, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = cond["labels"]
        t = torch.full((labels.shape[0],), float(model_time), device=labels.device)
        return self.model.condition(t, labels)

    def embed(self, x_band: torch.Tensor, row_offset: int, height: int, width: int, ctx) -> Stream:
        return (self.model.embed(x_band, row_offset=row_offset),)

    def block(self, index: int, stream: Stream, ctx) -> Stream:
        return (self.model.blocks[index](stream[0], ctx),)

    def head(self, stream: Stream, ctx, grid_cols: int) -> torch.Tensor:
        return self.model.head(stream[0], ctx, grid_cols)

    def stream_shapes(self, batch: int, image_tokens: int, ctx) -> list[tuple[int, ...]]:
        return [(batch, image_tokens, self.hidden_size)]

    @contextmanager
    def attention_kernel(self, kernel: AttentionKernel = serial_kernel) -> Iterator[None]:
        originals = [block.attn for block in self.model.blocks]
        try:
            for index, block in enumerate(self.model.blocks):
                block.attn = KernelAttention(originals[index], index, kernel)
            yield
        finally:
            for block, original in zip(self.model.blocks, originals, strict=True):
                block.attn = original


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of a supported model class; a ValueError naming the class otherwise."""
    if isinstance(model, DiT):
        return TesseraDiTAdapter(model)
    from tessera.diffusion.diffusers_adapters import diffusers_adapter_for

    adapter = diffusers_adapter_for(model)
    if adapter is None:
        raise ValueError(
            f"no parallel method supports {type(model).__name__}; supported: tessera DiT, "
            "diffusers PixArtTransformer2DModel"
        )
    return adapter
