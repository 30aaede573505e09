"""Blockwise softmax attention: one block of keys at a time with its log-sum-exp, and the
exact merge of two blocks' results (online softmax). The one kernel Ring attention uses
for inference (``tessera.diffusion.attention``) and for training
(``tessera.parallel.sequence``).

Tensors are (batch, heads, tokens, head_dim). Training attention honours what transformers'
decoder families ask of it (``Visibility``): which keys a query sees by global token
position (causal, a sliding window, a padding mask over the keys), soft-capped scores
(Gemma-2) and a scale other than 1/sqrt(head_dim). A query that sees no key (a padding
position at the start of a left-padded row) gets a zero output and a log-sum-exp of -inf,
as torch's ``scaled_dot_product_attention`` gives it: never a NaN that would spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over one block of keys, and the log-sum-exp of its scores
    (B, H, Nq, 1): what is needed to merge blocks exactly. ``causal``: query i sees keys
    0..i of the block (a block on the diagonal of a causal sequence)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.device.type == "cpu":  # torch's fused CPU kernel returns the log-sum-exp too (~2x the math path)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=causal, scale=scale
        )[:2]
        return out, lse.unsqueeze(-1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, NEG_INF)
    lse = torch.logsumexp(scores.float(), dim=-1, keepdim=True)
    out = torch.exp(scores.float() - lse).to(v.dtype) @ v
    return out, lse


def finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a query that sees no key) as 0, so exp(score - lse) stays 0 there."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def merge_blocks(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two key blocks from the two partial results (a row that
    saw no key in either stays zero with a log-sum-exp of -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = finite(lse)
    out = out_a.float() * torch.exp(lse_a - safe) + out_b.float() * torch.exp(lse_b - safe)
    return out.to(out_a.dtype), lse


@dataclass(frozen=True)
class Visibility:
    """What a decoder layer's attention asks, beyond softmax(q k^T) v: ``scale`` of the
    scores, ``window`` (key k is visible from query q only if q - window < k, transformers'
    sliding window), ``softcap`` (scores s become softcap * tanh(s / softcap) before
    masking, Gemma-2), ``causal`` (k <= q)."""

    scale: float
    causal: bool = True
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self):
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window {self.window} must be a positive number of tokens")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"attention soft-cap {self.softcap} must be positive")

    def cut(self, qs: range, ks: range) -> str:
        """How the window and causality cut a block of query positions ``qs`` (contiguous)
        over key positions ``ks``: "none" (no key visible), "all", "diagonal" (the same
        positions, causal inside) or "partial"."""
        q_lo, q_hi, k_lo, k_hi = qs.start, qs.stop - 1, ks.start, ks.stop - 1
        if self.causal and k_lo > q_hi:
            return "none"
        if self.window is not None and k_hi <= q_lo - self.window:
            return "none"
        inside_window = self.window is None or k_lo > q_hi - self.window
        if inside_window and (not self.causal or k_hi <= q_lo):
            return "all"
        if inside_window and self.causal and qs == ks:
            return "diagonal"
        return "partial"

    def mask(self, qs: range, ks: range, device) -> torch.Tensor:
        """(Tq, Tk) bool: True where query position qs[i] sees key position ks[j]."""
        q = torch.arange(qs.start, qs.stop, device=device)[:, None]
        k = torch.arange(ks.start, ks.stop, device=device)[None, :]
        seen = torch.ones(len(qs), len(ks), dtype=torch.bool, device=device)
        if self.causal:
            seen &= k <= q
        if self.window is not None:
            seen &= k > q - self.window
        return seen


def block_mask(vis: Visibility, qs: range, ks: range, key_valid: torch.Tensor | None, device):
    """The (B or 1, 1, Tq, Tk) bool mask of a block, or None where every key is visible;
    ``key_valid`` (B, Tk): False for a padding key."""
    cut = vis.cut(qs, ks)
    mask = None if cut == "all" else vis.mask(qs, ks, device)[None, None]
    if key_valid is not None and not bool(key_valid.all()):
        pad = key_valid[:, None, None, :]
        mask = pad if mask is None else mask & pad
    return mask


def block_scores(q, k, vis: Visibility, mask):
    """(raw scaled scores, scores after soft-cap and mask) of q over one key block, fp32."""
    raw = (q.float() @ k.float().transpose(-1, -2)) * vis.scale
    s = vis.softcap * torch.tanh(raw / vis.softcap) if vis.softcap is not None else raw
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    return raw, s


def visible_block(q, k, v, vis: Visibility, qs: range, ks: range, key_valid=None):
    """Attention of queries at positions ``qs`` over one block of keys at ``ks`` and its
    log-sum-exp (fp32), or None when no query sees any key of the block."""
    cut = vis.cut(qs, ks)
    if cut == "none":
        return None
    padded = key_valid is not None and not bool(key_valid.all())
    if vis.softcap is None and not padded and cut in ("all", "diagonal"):
        return attention_with_lse(q.float(), k.float(), v.float(), causal=cut == "diagonal", scale=vis.scale)
    mask = block_mask(vis, qs, ks, key_valid, q.device)
    _, s = block_scores(q, k, vis, mask)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    out = torch.exp(s - finite(lse)) @ v.float()
    return out, lse


def block_backward(q, k, v, g, lse, delta, vis: Visibility, qs: range, ks: range, key_valid=None):
    """Gradients (dq, dk, dv) of one block's share of the attention, given the upstream
    gradient ``g``, the final log-sum-exp ``lse`` over every block (and sink) and
    ``delta`` = rowsum(g * out); None when the block is masked whole."""
    if vis.cut(qs, ks) == "none":
        return None
    mask = block_mask(vis, qs, ks, key_valid, q.device)
    raw, s = block_scores(q, k, vis, mask)
    p = torch.exp(s - finite(lse))
    dv = p.transpose(-1, -2) @ g
    ds = p * (g @ v.float().transpose(-1, -2) - delta)
    if vis.softcap is not None:  # d/dx of c tanh(x / c) is 1 - tanh^2
        ds = ds * (1 - torch.tanh(raw / vis.softcap) ** 2)
    dq = ds @ k.float() * vis.scale
    dk = ds.transpose(-1, -2) @ q.float() * vis.scale
    return dq, dk, dv


def add_sinks(out, lse, sinks: torch.Tensor):
    """Attention sinks (gpt-oss): one learned logit per head joins every row's softmax with
    a zero value, so the row's weights sum to less than one. (out, lse) over the keys ->
    (out, lse) with the sinks."""
    sink = sinks.float().view(1, -1, 1, 1).expand_as(lse)
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - finite(total)), total
