"""Blockwise softmax attention: one block of keys at a time with its log-sum-exp, and the
exact merge of two blocks' results (online softmax). The one kernel Ring attention uses
for inference (``tessera.diffusion.attention``) and for training
(``tessera.parallel.sequence``).

Tensors are (batch, heads, tokens, head_dim).
"""

from __future__ import annotations

import math

import torch


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over one block of keys, and the log-sum-exp of its scores
    (B, H, Nq, 1): what is needed to merge blocks exactly. ``causal``: query i sees keys
    0..i of the block (a block on the diagonal of a causal sequence)."""
    if q.device.type == "cpu":  # torch's fused CPU kernel returns the log-sum-exp too (~2x the math path)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal)[:2]
        return out, lse.unsqueeze(-1)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1, keepdim=True)
    out = torch.exp(scores.float() - lse).to(v.dtype) @ v
    return out, lse


def merge_blocks(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two key blocks from the two partial results."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a.float() * torch.exp(lse_a - lse) + out_b.float() * torch.exp(lse_b - lse)
    return out.to(out_a.dtype), lse
