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

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from tessera.diffusion.attention import attend

# kernel(layer_index, q, k, v[, text]) -> attention output, all (B, H, tokens, head_dim);
# with text=(q, k, v) of joint-attention text tokens: (image output, text output)
AttentionKernel = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Stream = tuple[torch.Tensor, ...]


def serial_kernel(layer: int, q, k, v, text=None):
    return attend(q, k, v, text)


class Adapter(Protocol):
    model: nn.Module
    blocks: nn.ModuleList  # the transformer layers, in order
    patch_size: int
    in_channels: int
    num_layers: int
    num_heads: int
    hidden_size: int

    def check_size(self, height: int, width: int) -> None: ...
    def prepare(self, model_time: Any, cond: dict[str, torch.Tensor], height: int, width: int) -> Any: ...
    def embed(self, x_band: torch.Tensor, row_offset: int, height: int, width: int, ctx: Any) -> Stream: ...
    def block(self, index: int, stream: Stream, ctx: Any, spans: list[tuple[int, int]]) -> Stream:
        """Layer ``index`` on a stream whose image tokens are the ranges ``spans`` of the
        image's tokens, concatenated in order."""
        ...

    def head(self, stream: Stream, ctx: Any, grid_cols: int) -> torch.Tensor: ...
    def stream_shapes(self, batch: int, image_tokens: int, ctx: Any) -> list[tuple[int, ...]]: ...
    def check_cond(self, cond: dict[str, torch.Tensor]) -> None:
        """A ValueError naming a conditioning key this model needs and lacks, or one it would
        ignore (a mask under a name the adapter does not read, say)."""
        ...

    def check_attention(self) -> None:
        """A ValueError naming the first attention layer whose computation ``attention_kernel``
        would not reproduce (see ``diffusers_common.check_attention_modules``)."""
        ...

    def attention_kernel(self, kernel: AttentionKernel) -> Any:
        """Swap the kernel in (after ``check_attention``) for the duration of a ``with``."""
        ...


def check_patch_size(height: int, width: int, patch_size: int) -> None:
    if height % patch_size or width % patch_size:
        raise ValueError(f"image size {height}x{width} is not divisible by the patch size {patch_size}")


def check_cond_keys(
    model: str, cond: dict, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> None:
    missing = [k for k in required if k not in cond]
    if missing:
        raise ValueError(f"{model} needs conditioning {', '.join(missing)}; got {', '.join(cond) or 'none'}")
    unknown = [k for k in cond if k not in required + optional]
    if unknown:
        raise ValueError(
            f"{model} does not read conditioning {', '.join(map(repr, unknown))}, which would be ignored; "
            f"it reads {', '.join(required + optional)}"
        )
