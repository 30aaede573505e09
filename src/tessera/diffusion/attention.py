"""Attention kernels for sequence-split inference: exact blockwise attention with
log-sum-exp merging (``tessera.parallel.attention_blocks``, the kernel training's Ring uses
too), Ulysses (all-to-all over heads) and Ring (K/V passed around, overlapped with compute).

Tensors are (batch, heads, tokens, head_dim). All math is plain PyTorch, so the same
code runs on CPU/gloo and CUDA/NCCL (torch's own context-parallel attention has no CPU
sharding rule; see TORCH_ON_CPU.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.parallel.attention_blocks import attention_with_lse, merge_blocks
from tessera.runtime.comm import Comm

__all__ = ["attend", "attention", "attention_with_lse", "merge_blocks", "ring_attention", "ulysses_attention"]

# Joint attention (SD3, Flux): the text tokens' (q, k, v), replicated on every rank, that
# join the image tokens' attention. A kernel given ``text`` returns (image out, text out).
Text = tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text: Text = None):
    """Attention of the image queries ``q`` over the image keys ``k, v`` available here;
    with ``text``, text and image tokens attend jointly over both (order does not matter
    to softmax attention: positions were encoded before)."""
    if text is None:
        return attention(q, k, v)
    qt, kt, vt = text
    n = q.shape[2]
    out = attention(torch.cat([q, qt], dim=2), torch.cat([k, kt], dim=2), torch.cat([v, vt], dim=2))
    return out[:, :, :n], out[:, :, n:]


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, axis: str, text: Text = None
):
    """Attention of the local queries over the keys of every rank on ``axis``.

    Each of the N-1 rounds sends the K/V block in hand to the next rank and receives the
    previous rank's, while the block in hand is being used (Liu et al., Ring Attention).
    All blocks have the local shape. With ``text``, the text queries join the local
    queries and the text K/V is merged in once, locally, so every rank computes the text
    tokens' attention over the whole image.
    """
    n = comm.mesh.size(axis)
    if n == 1:
        return attend(q, k, v, text)
    me = comm.mesh.rank(axis)
    image_queries = q.shape[2]
    out, lse = None, None
    if text is not None:
        q = torch.cat([q, text[0]], dim=2)
        out, lse = attention_with_lse(q, text[1], text[2])
    kv = torch.stack([k, v]).contiguous()
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
    return out if text is None else (out[:, :, :image_queries], out[:, :, image_queries:])


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Comm,
    axis: str,
    ring_axis: str | None = None,
    text: Text = None,
):
    """DeepSpeed-Ulysses: trade the sequence split for a head split with one all-to-all,
    attend over the whole (ulysses-group) sequence, and trade back. With ``ring_axis`` the
    attention over the gathered sequence is itself a ring over that axis (USP). Text
    tokens (replicated) take this rank's heads, and their output heads are all-gathered."""
    heads, n = q.shape[1], comm.mesh.size(axis)
    if heads % n:
        raise ValueError(f"{heads} attention heads are not divisible by the Ulysses degree {n}")
    # (B, H, n_local, d) -> (B, H/N, N*n_local, d): scatter heads, gather tokens.
    q, k, v = (comm.all_to_all(t, axis, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    if text is not None:
        text = tuple(t.chunk(n, dim=1)[comm.mesh.rank(axis)] for t in text)
    if ring_axis is not None and comm.mesh.size(ring_axis) > 1:
        out = ring_attention(q, k, v, comm, ring_axis, text)
    else:
        out = attend(q, k, v, text)
    if text is None:
        return comm.all_to_all(out, axis, scatter_dim=2, gather_dim=1)
    image, text_out = out
    return comm.all_to_all(image, axis, scatter_dim=2, gather_dim=1), comm.all_gather(
        text_out.contiguous(), axis, dim=1
    )
