"""Megatron-style tensor parallel for DiT inference (the baseline PipeFusion is compared
against): attention heads and the MLP's hidden units split over the ``tp`` axis, one
all-reduce after the attention output projection and one after the MLP, per layer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tessera.diffusion.adapters import TesseraDiTAdapter
from tessera.runtime.mesh import Mesh

AXIS = "tp"


def _rows(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    """Column-parallel shard: output features [start, stop)."""
    shard = nn.Linear(
        linear.in_features, stop - start, device=linear.weight.device, dtype=linear.weight.dtype
    )
    shard.weight.data.copy_(linear.weight.data[start:stop])
    shard.bias.data.copy_(linear.bias.data[start:stop])
    return shard


class ShardedAttention(nn.Module):
    def __init__(self, inner: nn.Module, mesh: Mesh):
        super().__init__()
        n, r = mesh.size(AXIS), mesh.rank(AXIS)
        if inner.num_heads % n:
            raise ValueError(f"{inner.num_heads} attention heads are not divisible by the TP degree {n}")
        width = inner.to_q.out_features // n
        self.heads, self.mesh = inner.num_heads // n, mesh
        self.to_q, self.to_k, self.to_v = (
            _rows(f, r * width, (r + 1) * width) for f in (inner.to_q, inner.to_k, inner.to_v)
        )
        self.out_weight = inner.to_out.weight.data[:, r * width : (r + 1) * width].clone()  # row-parallel
        self.out_bias = inner.to_out.bias.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        partial = out @ self.out_weight.T
        self.mesh.comm.all_reduce(partial, AXIS)
        return partial + self.out_bias


class ShardedMLP(nn.Module):
    def __init__(self, inner: nn.Module, mesh: Mesh):
        super().__init__()
        n, r = mesh.size(AXIS), mesh.rank(AXIS)
        hidden = inner.fc1.out_features
        if hidden % n:
            raise ValueError(f"MLP width {hidden} is not divisible by the TP degree {n}")
        width = hidden // n
        self.mesh = mesh
        self.fc1 = _rows(inner.fc1, r * width, (r + 1) * width)
        self.fc2_weight = inner.fc2.weight.data[:, r * width : (r + 1) * width].clone()
        self.fc2_bias = inner.fc2.bias.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.gelu(self.fc1(x), approximate="tanh") @ self.fc2_weight.T
        self.mesh.comm.all_reduce(partial, AXIS)
        return partial + self.fc2_bias


@contextmanager
def tensor_parallel(adapter: TesseraDiTAdapter, mesh: Mesh) -> Iterator[None]:
    """Every block's attention and MLP replaced by this rank's shard, then restored."""
    blocks = adapter.blocks
    originals = [(block.attn, block.mlp) for block in blocks]
    try:
        for block, (attn, mlp) in zip(blocks, originals, strict=True):
            block.attn, block.mlp = ShardedAttention(attn, mesh), ShardedMLP(mlp, mesh)
        yield
    finally:
        for block, (attn, mlp) in zip(blocks, originals, strict=True):
            block.attn, block.mlp = attn, mlp
