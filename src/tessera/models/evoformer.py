"""The AlphaFold2 Evoformer (Jumper et al. 2021, Supplementary Information 1.6), plain PyTorch.

MSA representation ``m`` (B, s, r, c_m) and pair representation ``z`` (B, r, r, c_z),
with masks ``msa_mask`` (B, s, r) and ``pair_mask`` (B, r, r) (1 = real, 0 = padding).
Inference form: dropout is omitted. Algorithm numbers refer to the supplement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MASK_BIAS = -1e9  # additive logit for padded keys


@dataclass(frozen=True, kw_only=True)
class EvoformerConfig:
    c_m: int = 256  # MSA channels
    c_z: int = 128  # pair channels
    msa_heads: int = 8
    msa_head_dim: int = 32
    pair_heads: int = 4
    pair_head_dim: int = 32
    c_mul: int = 128  # triangle multiplication hidden channels
    c_opm: int = 32  # outer product mean hidden channels
    transition_factor: int = 4
    num_blocks: int = 48

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EvoformerConfig.{name} must be a positive integer, got {value!r}")


def _gated_attention(q, k, v, bias, gate, out_proj) -> torch.Tensor:
    """q/k/v (..., H, n, d), bias broadcastable to (..., H, n, n), gate (..., n, H*d).

    The leading dims are folded into one batch dim so torch's fused 4-D attention kernel
    runs (the (..., H, n, n) logits are never stored)."""
    lead, tail = q.shape[:-3], q.shape[-3:]
    bias = bias.to(q.dtype).expand(*lead, *bias.shape[-3:])
    out = F.scaled_dot_product_attention(
        q.reshape(-1, *tail),
        k.reshape(-1, *tail),
        v.reshape(-1, *v.shape[-3:]),
        attn_mask=bias.reshape(-1, *bias.shape[-3:]),
    )
    out = out.reshape(*lead, *out.shape[-3:]).transpose(-2, -3).flatten(-2)  # (..., n, H*d)
    return out_proj(torch.sigmoid(gate) * out)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(..., n, H*d) -> (..., H, n, d)."""
    return x.unflatten(-1, (heads, -1)).transpose(-2, -3)


def _key_mask_bias(mask: torch.Tensor) -> torch.Tensor:
    """(..., n) keys mask -> additive bias (..., 1, 1, n)."""
    return ((1.0 - mask) * MASK_BIAS)[..., None, None, :]


class GatedSelfAttention(nn.Module):
    """Multi-head attention along the second-to-last axis with a sigmoid gate."""

    def __init__(self, channels: int, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(channels)
        self.to_qkv = nn.Linear(channels, 3 * heads * head_dim, bias=False)
        self.to_gate = nn.Linear(channels, heads * head_dim)
        self.to_out = nn.Linear(heads * head_dim, channels)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., n, c), mask (..., n), bias (H, n, n)-broadcastable or None."""
        h = self.norm(x)
        q, k, v = (_heads(t, self.heads) for t in self.to_qkv(h).chunk(3, dim=-1))
        total = _key_mask_bias(mask)
        if bias is not None:
            total = total + bias
        return _gated_attention(q, k, v, total, self.to_gate(h), self.to_out)


class MSARowAttentionWithPairBias(nn.Module):
    """Algorithm 7: each sequence attends along residues, biased by the pair representation."""

    def __init__(self, cfg: EvoformerConfig):
        super().__init__()
        self.attention = GatedSelfAttention(cfg.c_m, cfg.msa_heads, cfg.msa_head_dim)
        self.pair_norm = nn.LayerNorm(cfg.c_z)
        self.pair_bias = nn.Linear(cfg.c_z, cfg.msa_heads, bias=False)

    def forward(self, m, z, msa_mask):
        bias = self.pair_bias(self.pair_norm(z)).permute(0, 3, 1, 2)[:, None]  # (B, 1, H, r, r)
        return self.attention(m, msa_mask, bias)


class MSAColumnAttention(nn.Module):
    """Algorithm 8: each residue column attends along sequences."""

    def __init__(self, cfg: EvoformerConfig):
        super().__init__()
        self.attention = GatedSelfAttention(cfg.c_m, cfg.msa_heads, cfg.msa_head_dim)

    def forward(self, m, msa_mask):
        return self.attention(m.transpose(-2, -3), msa_mask.transpose(-1, -2)).transpose(-2, -3)


class Transition(nn.Module):
    """Algorithms 9 and 15: a two-layer MLP with a wider hidden layer."""

    def __init__(self, channels: int, factor: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.fc1 = nn.Linear(channels, factor * channels)
        self.fc2 = nn.Linear(factor * channels, channels)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(self.norm(x))))


class OuterProductMean(nn.Module):
    """Algorithm 10: the MSA's mean outer product over sequences updates the pair."""

    def __init__(self, cfg: EvoformerConfig, eps: float = 1e-3):
        super().__init__()
        self.eps = eps
        self.norm = nn.LayerNorm(cfg.c_m)
        self.left = nn.Linear(cfg.c_m, cfg.c_opm)
        self.right = nn.Linear(cfg.c_m, cfg.c_opm)
        self.to_out = nn.Linear(cfg.c_opm * cfg.c_opm, cfg.c_z)

    def forward(self, m, msa_mask):
        h = self.norm(m)
        mask = msa_mask[..., None].to(h.dtype)
        a, b = self.left(h) * mask, self.right(h) * mask  # (B, s, r, c)
        outer = torch.einsum("bsic,bsjd->bijcd", a, b).flatten(-2)
        count = torch.einsum("bsi,bsj->bij", msa_mask.to(h.dtype), msa_mask.to(h.dtype))[..., None]
        return self.to_out(outer) / (count + self.eps)


class TriangleMultiplication(nn.Module):
    """Algorithms 11 (outgoing edges: z_ij from a_ik * b_jk) and 12 (incoming: a_ki * b_kj)."""

    def __init__(self, cfg: EvoformerConfig, outgoing: bool):
        super().__init__()
        self.outgoing = outgoing
        self.norm_in = nn.LayerNorm(cfg.c_z)
        self.left, self.left_gate = nn.Linear(cfg.c_z, cfg.c_mul), nn.Linear(cfg.c_z, cfg.c_mul)
        self.right, self.right_gate = nn.Linear(cfg.c_z, cfg.c_mul), nn.Linear(cfg.c_z, cfg.c_mul)
        self.norm_out = nn.LayerNorm(cfg.c_mul)
        self.to_out = nn.Linear(cfg.c_mul, cfg.c_z)
        self.out_gate = nn.Linear(cfg.c_z, cfg.c_z)

    def forward(self, z, pair_mask):
        h = self.norm_in(z)
        mask = pair_mask[..., None].to(h.dtype)
        a = torch.sigmoid(self.left_gate(h)) * self.left(h) * mask
        b = torch.sigmoid(self.right_gate(h)) * self.right(h) * mask
        if self.outgoing:
            x = torch.einsum("bikc,bjkc->bijc", a, b)
        else:
            x = torch.einsum("bkic,bkjc->bijc", a, b)
        return torch.sigmoid(self.out_gate(h)) * self.to_out(self.norm_out(x))


class TriangleAttention(nn.Module):
    """Algorithms 13 (starting node: z_ij attends to z_ik with bias b_jk) and 14 (ending
    node: z_ij attends to z_kj with bias b_ki, i.e. algorithm 13 on the transposed pair)."""

    def __init__(self, cfg: EvoformerConfig, starting: bool):
        super().__init__()
        self.starting = starting
        self.attention = GatedSelfAttention(cfg.c_z, cfg.pair_heads, cfg.pair_head_dim)
        self.to_bias = nn.Linear(cfg.c_z, cfg.pair_heads, bias=False)

    def forward(self, z, pair_mask):
        if not self.starting:
            z, pair_mask = z.transpose(1, 2), pair_mask.transpose(1, 2)
        bias = self.to_bias(self.attention.norm(z)).permute(0, 3, 1, 2)[:, None]  # (B, 1, H, r, r)
        out = self.attention(z, pair_mask, bias)
        return out if self.starting else out.transpose(1, 2)


class EvoformerBlock(nn.Module):
    """Algorithm 6, one block: MSA stack then pair stack, each update a residual."""

    def __init__(self, cfg: EvoformerConfig):
        super().__init__()
        self.msa_row = MSARowAttentionWithPairBias(cfg)
        self.msa_column = MSAColumnAttention(cfg)
        self.msa_transition = Transition(cfg.c_m, cfg.transition_factor)
        self.outer_product_mean = OuterProductMean(cfg)
        self.tri_mul_out = TriangleMultiplication(cfg, outgoing=True)
        self.tri_mul_in = TriangleMultiplication(cfg, outgoing=False)
        self.tri_att_start = TriangleAttention(cfg, starting=True)
        self.tri_att_end = TriangleAttention(cfg, starting=False)
        self.pair_transition = Transition(cfg.c_z, cfg.transition_factor)

    def forward(self, m, z, msa_mask, pair_mask):
        m = m + self.msa_row(m, z, msa_mask)
        m = m + self.msa_column(m, msa_mask)
        m = m + self.msa_transition(m)
        z = z + self.outer_product_mean(m, msa_mask)
        z = z + self.tri_mul_out(z, pair_mask)
        z = z + self.tri_mul_in(z, pair_mask)
        z = z + self.tri_att_start(z, pair_mask)
        z = z + self.tri_att_end(z, pair_mask)
        z = z + self.pair_transition(z)
        return m, z


class Evoformer(nn.Module):
    """A stack of ``num_blocks`` Evoformer blocks; checks shapes against the config."""

    def __init__(self, cfg: EvoformerConfig):
        super().__init__()
        self.config = cfg
        self.blocks = nn.ModuleList(EvoformerBlock(cfg) for _ in range(cfg.num_blocks))

    def check_inputs(self, m, z, msa_mask, pair_mask) -> None:
        cfg = self.config
        if m.dim() != 4 or m.shape[-1] != cfg.c_m:
            raise ValueError(f"MSA must be (B, s, r, c_m={cfg.c_m}), got {tuple(m.shape)}")
        b, _, r, _ = m.shape
        if tuple(z.shape) != (b, r, r, cfg.c_z):
            raise ValueError(
                f"pair must be (B={b}, r={r}, r={r}, c_z={cfg.c_z}) to match the MSA, got {tuple(z.shape)}"
            )
        if tuple(msa_mask.shape) != tuple(m.shape[:3]):
            raise ValueError(f"msa_mask must be {tuple(m.shape[:3])}, got {tuple(msa_mask.shape)}")
        if tuple(pair_mask.shape) != tuple(z.shape[:3]):
            raise ValueError(f"pair_mask must be {tuple(z.shape[:3])}, got {tuple(pair_mask.shape)}")

    def forward(self, m, z, msa_mask=None, pair_mask=None):
        msa_mask = torch.ones(m.shape[:3], device=m.device) if msa_mask is None else msa_mask
        pair_mask = torch.ones(z.shape[:3], device=z.device) if pair_mask is None else pair_mask
        self.check_inputs(m, z, msa_mask, pair_mask)
        for block in self.blocks:
            m, z = block(m, z, msa_mask, pair_mask)
        return m, z
