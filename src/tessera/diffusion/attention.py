"""Attention kernels for sequence-split inference: exact blockwise attention with
log-sum-exp merging, Ulysses (all-to-all over heads) and Ring (K/V passed around).

Tensors are (batch, heads, tokens, head_dim). All math is plain PyTorch, so the same
code runs on CPU/gloo and CUDA/NCCL (torch's own context-parallel attention has no CPU
sharding rule; see TORCH_ON_CPU.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tessera.runtime.comm import Comm


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over one block of keys, and the log-sum-exp of its scores
    (B, H, Nq, 1): what is needed to merge blocks exactly (online softmax)."""
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    lse = torch.logsumexp(scores.float(), dim=-1, keepdim=True)
    out = torch.exp(scores.float() - lse).to(v.dtype) @ v
    return out, lse


def merge_blocks(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two key blocks from the two partial results."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a.float() * torch.exp(lse_a - lse) + out_b.float() * torch.exp(lse_b - lse)
    return out.to(out_a.dtype), lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """Attention of the local queries over the keys of every rank on ``axis``.

    Each of the N-1 rounds sends the K/V block in hand to the next rank and receives the
    previous rank's, while the block in hand is being used (Liu et al., Ring Attention).
    Blocks may differ in length between ranks only if every rank knows all lengths, so
    here all blocks have the local shape.
    """
    n = comm.mesh.size(axis)
    if n == 1:
        return attention(q, k, v)
    me = comm.mesh.rank(axis)
    kv = torch.stack([k, v]).contiguous()
    out, lse = None, None
    for round_index in range(n):
        pending = []
        if round_index < n - 1:
            incoming = torch.empty_like(kv)
            pending = [
                comm.isend(kv, axis, dst=(me + 1) % n),
                comm.irecv(incoming, axis, src=(me - 1) % n),
            ]
        block_out, block_lse = attention_with_lse(q, kv[0], kv[1])
        if out is None:
            out, lse = block_out, block_lse
        else:
            out, lse = merge_blocks(out, lse, block_out, block_lse)
        for work in pending:
            work.wait()
        if pending:
            kv = incoming
    return out


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, axis: str, ring_axis: str | None = None
) -> torch.Tensor:
    """DeepSpeed-Ulysses: trade the sequence split for a head split with one all-to-all,
    attend over the whole (ulysses-group) sequence, and trade back. With ``ring_axis`` the
    attention over the gathered sequence is itself a ring over that axis (USP)."""
    heads, n = q.shape[1], comm.mesh.size(axis)
    if heads % n:
        raise ValueError(f"{heads} attention heads are not divisible by the Ulysses degree {n}")
    # (B, H, n_local, d) -> (B, H/N, N*n_local, d): scatter heads, gather tokens.
    q, k, v = (comm.all_to_all(t, axis, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    if ring_axis is not None and comm.mesh.size(ring_axis) > 1:
        out = ring_attention(q, k, v, comm, ring_axis)
    else:
        out = attention(q, k, v)
    return comm.all_to_all(out, axis, scatter_dim=2, gather_dim=1)
