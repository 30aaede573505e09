"""A class-conditional diffusion transformer (DiT, Peebles & Xie 2023), plain PyTorch.

Patchify -> transformer blocks with adaLN-zero conditioning -> unpatchify. The forward
pass is split into named steps (``embed``, ``condition``, ``blocks``, ``head``) so that
parallel methods applied from outside can run them on a slice of the token sequence
without this file knowing anything about parallelism.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class DiTConfig:
    image_size: int = 8
    in_channels: int = 1
    patch_size: int = 1
    hidden_size: int = 128
    depth: int = 4
    num_heads: int = 4
    mlp_ratio: float = 4.0
    num_classes: int = 10

    def __post_init__(self) -> None:
        for name in (
            "image_size",
            "in_channels",
            "patch_size",
            "hidden_size",
            "depth",
            "num_heads",
            "num_classes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DiTConfig.{name} must be a positive integer, got {value!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DiTConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown DiTConfig fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)


def sincos_embedding(positions: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of real-valued positions: (N,) -> (N, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs.to(positions.device)[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def sincos_2d(row_start: int, rows: int, cols: int, dim: int) -> torch.Tensor:
    """Fixed 2-D position embedding of grid rows ``row_start..row_start+rows`` and columns
    ``0..cols``: (rows*cols, dim), row-major over (row, col)."""
    row_ids = torch.arange(row_start, row_start + rows, dtype=torch.float32)
    col_ids = torch.arange(cols, dtype=torch.float32)
    row_feat = sincos_embedding(row_ids.repeat_interleave(cols), dim // 2)
    col_feat = sincos_embedding(col_ids.repeat(rows), dim // 2)
    return torch.cat([row_feat, col_feat], dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(
            nn.Linear(freq_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        features = sincos_embedding(t, self.freq_dim)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.to_q = nn.Linear(hidden_size, hidden_size)
        self.to_k = nn.Linear(hidden_size, hidden_size)
        self.to_v = nn.Linear(hidden_size, hidden_size)
        self.to_out = nn.Linear(hidden_size, hidden_size)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split_heads(f(x)) for f in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, mlp_ratio: float):
        super().__init__()
        inner = int(hidden_size * mlp_ratio)
        self.fc1 = nn.Linear(hidden_size, inner)
        self.fc2 = nn.Linear(inner, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """Pre-norm attention + MLP, each gated and modulated by the conditioning (adaLN-zero)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(hidden_size, mlp_ratio)
        self.adaln = nn.Linear(hidden_size, 6 * hidden_size)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln(F.silu(c)).chunk(6, dim=-1)
        x = x + gate1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1))
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, out_features: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.adaln = nn.Linear(hidden_size, 2 * hidden_size)
        self.linear = nn.Linear(hidden_size, out_features)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaln(F.silu(c)).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


class DiT(nn.Module):
    """``forward(x, t, y)``: latents (B, C, H, W), times in [0, 1] (B,), labels (B,)
    -> velocity (B, C, H, W). Label ``num_classes`` is the null (unconditional) class.
    H and W may differ from ``config.image_size`` (the training size) if the patch size
    divides them: positions are fixed sin-cos features computed for the actual grid."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.config = config
        c, p, h = config.in_channels, config.patch_size, config.hidden_size
        self.patch_embed = nn.Linear(c * p * p, h)
        self.t_embed = TimestepEmbedder(h)
        self.y_embed = nn.Embedding(config.num_classes + 1, h)
        self.blocks = nn.ModuleList(
            DiTBlock(h, config.num_heads, config.mlp_ratio) for _ in range(config.depth)
        )
        self.final = FinalLayer(h, c * p * p)
        self.reset_parameters()

    @property
    def null_class(self) -> int:
        return self.config.num_classes

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.y_embed.weight, std=0.02)
        for block in self.blocks:  # adaLN-zero: every block starts as the identity
            nn.init.zeros_(block.adaln.weight)
        nn.init.zeros_(self.final.adaln.weight)
        nn.init.zeros_(self.final.linear.weight)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, tokens, C*p*p), tokens row-major over the patch grid."""
        b, c, hh, ww = x.shape
        p = self.config.patch_size
        x = x.reshape(b, c, hh // p, p, ww // p, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (hh // p) * (ww // p), c * p * p)

    def unpatchify(self, tokens: torch.Tensor, grid_cols: int) -> torch.Tensor:
        """(B, rows*grid_cols, C*p*p) -> (B, C, rows*p, grid_cols*p)."""
        b = tokens.shape[0]
        c, p = self.config.in_channels, self.config.patch_size
        rows = tokens.shape[1] // grid_cols
        x = tokens.reshape(b, rows, grid_cols, c, p, p)
        return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, rows * p, grid_cols * p)

    def embed(self, x: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
        """Tokens of ``x`` with their position embedding added. ``x`` may be a horizontal
        band of a larger image whose first token row is ``row_offset`` of the full grid."""
        p = self.config.patch_size
        tokens = self.patch_embed(self.patchify(x))
        pos = sincos_2d(row_offset, x.shape[2] // p, x.shape[3] // p, tokens.shape[-1])
        return tokens + pos.to(device=tokens.device, dtype=tokens.dtype)

    def condition(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.t_embed(t * 1000.0) + self.y_embed(y)

    def head(self, tokens: torch.Tensor, c: torch.Tensor, grid_cols: int) -> torch.Tensor:
        return self.unpatchify(self.final(tokens, c), grid_cols)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        c = self.condition(t, y)
        tokens = self.embed(x)
        for block in self.blocks:
            tokens = block(tokens, c)
        return self.head(tokens, c, x.shape[3] // self.config.patch_size)

    def check_input(self, x: torch.Tensor) -> None:
        c, p = self.config.in_channels, self.config.patch_size
        if x.dim() != 4 or x.shape[1] != c:
            raise ValueError(f"DiT expects latents of shape (B, {c}, H, W), got {tuple(x.shape)}")
        if x.shape[2] % p or x.shape[3] % p:
            raise ValueError(f"image size {x.shape[2]}x{x.shape[3]} is not divisible by the patch size {p}")
