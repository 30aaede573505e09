"""Sequence-parallel attention for training: Ulysses and Ring, forward and backward, causal
or not, over the ``sp`` axis of a Mesh.

Tensors are (batch, heads, local tokens, head_dim), the sequence split over the axis.

Ulysses trades the sequence split for a head split with one all-to-all (differentiable in
``runtime.comm``: its gradient is the inverse all-to-all), attends over the whole sequence
for its heads with torch's attention, and trades back. Causal masking is plain: each rank
sees the whole sequence.

Ring passes K/V blocks round the ring and merges the blocks' results by their
log-sum-exp (online softmax), with the block kernel inference uses
(``tessera.parallel.attention_blocks``). Its backward is written out (``_RingAttention``): the K/V
blocks go round again, each rank adds its queries' contribution to the block's dK/dV, and
the accumulated dK/dV travel with the block until they are back at its owner. For causal
attention the sequence is laid out zig-zag (``zigzag_split``): with 2N chunks, rank r holds
chunks r and 2N-1-r, so every rank does the same work (Brandon et al., Striped / zig-zag
ring attention); a chunk pair is skipped, masked or computed whole by its global indices.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tessera.parallel.attention_blocks import attention_with_lse, merge_blocks
from tessera.runtime.comm import Comm


def ulysses_attention(q, k, v, comm: Comm, axis: str, *, causal: bool = False) -> torch.Tensor:
    heads, n = q.shape[1], comm.mesh.size(axis)
    if heads % n:
        raise ValueError(f"{heads} attention heads are not divisible by the Ulysses degree {axis}={n}")
    q, k, v = (comm.all_to_all(t, axis, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return comm.all_to_all(out, axis, scatter_dim=2, gather_dim=1)


def zigzag_split(x: torch.Tensor, n: int, rank: int, dim: int = 2) -> torch.Tensor:
    """This rank's share of the full sequence ``x`` in the zig-zag layout: chunks rank and
    2n-1-rank of 2n."""
    if x.shape[dim] % (2 * n):
        raise ValueError(f"sequence of {x.shape[dim]} tokens does not split into 2 x {n} equal chunks")
    chunks = x.chunk(2 * n, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * n - 1 - rank]], dim=dim)


def zigzag_merge(parts: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's zig-zag share (inverse of ``zigzag_split``)."""
    n = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([halves[r][0] for r in range(n)] + [halves[r][1] for r in reversed(range(n))], dim=dim)


def _chunk_ids(rank: int, n: int, causal: bool) -> list[int]:
    """Global chunk index of each local sub-block (zig-zag for causal, one block otherwise)."""
    return [rank, 2 * n - 1 - rank] if causal else [rank]


def _scores(q, k, qi: int, ki: int, causal: bool):
    """Scaled scores of a query chunk over a key chunk, or None where causality masks all."""
    if causal and ki > qi:
        return None
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal and ki == qi:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _pass(comm: Comm, t: torch.Tensor, axis: str, n: int, me: int) -> torch.Tensor:
    incoming = torch.empty_like(t)
    works = [comm.isend(t, axis, dst=(me + 1) % n), comm.irecv(incoming, axis, src=(me - 1) % n)]
    for w in works:
        w.wait()
    return incoming


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, axis: str, causal: bool):
        n, me = comm.mesh.size(axis), comm.mesh.rank(axis)
        parts = len(_chunk_ids(me, n, causal))
        qs = [c.float() for c in q.chunk(parts, dim=2)]
        outs: list = [None] * parts
        lses: list = [None] * parts
        kv = torch.stack([k, v]).contiguous()
        for step in range(n):
            src = (me - step) % n
            for a, qi in enumerate(_chunk_ids(me, n, causal)):
                for kb, ki in zip(kv.chunk(parts, dim=3), _chunk_ids(src, n, causal), strict=True):
                    if causal and ki > qi:  # a later chunk: masked whole
                        continue
                    # the inference kernel; a diagonal chunk pair is causal within itself
                    o, lse = attention_with_lse(
                        qs[a], kb[0].float(), kb[1].float(), causal=causal and ki == qi
                    )
                    if outs[a] is None:
                        outs[a], lses[a] = o, lse
                    else:
                        outs[a], lses[a] = merge_blocks(outs[a], lses[a], o, lse)
            if step < n - 1:
                kv = _pass(comm, kv, axis, n, me)
        out = torch.cat(outs, dim=2)
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, dim=2))
        ctx.comm, ctx.axis, ctx.causal = comm, axis, causal
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, axis, causal = ctx.comm, ctx.axis, ctx.causal
        n, me = comm.mesh.size(axis), comm.mesh.rank(axis)
        ids = _chunk_ids(me, n, causal)
        parts, scale = len(ids), 1.0 / math.sqrt(q.shape[-1])
        g = grad_out.float()
        delta = (g * out).sum(-1, keepdim=True)  # D = rowsum(dO * O)
        qs, gs, ls, ds = (t.chunk(parts, dim=2) for t in (q.float(), g, lse, delta))
        dq = [torch.zeros_like(c) for c in qs]
        # The block in hand and its dK/dV so far travel together: (k, v, dk, dv).
        block = torch.stack(
            [
                k.float(),
                v.float(),
                torch.zeros_like(k, dtype=torch.float32),
                torch.zeros_like(v, dtype=torch.float32),
            ]
        )
        for step in range(n):
            src = (me - step) % n
            kb, vb, dkb, dvb = (t.chunk(parts, dim=2) for t in block.unbind(0))
            for a, qi in enumerate(ids):
                for b, ki in enumerate(_chunk_ids(src, n, causal)):
                    s = _scores(qs[a], kb[b], qi, ki, causal)
                    if s is None:
                        continue
                    p = torch.exp(s - ls[a])
                    dvb[b].add_(p.transpose(-1, -2) @ gs[a])
                    ds_ = p * (gs[a] @ vb[b].transpose(-1, -2) - ds[a])
                    dq[a].add_(ds_ @ kb[b] * scale)
                    dkb[b].add_(ds_.transpose(-1, -2) @ qs[a] * scale)
            block = _pass(comm, block.contiguous(), axis, n, me)  # after n passes: home again
        dk, dv = block[2], block[3]
        return torch.cat(dq, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q, k, v, comm: Comm, axis: str, *, causal: bool = False) -> torch.Tensor:
    """Attention of the local queries over every rank's keys on ``axis``; with ``causal``
    the local tokens must be this rank's ``zigzag_split`` share."""
    if comm.mesh.size(axis) == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _RingAttention.apply(q, k, v, comm, axis, causal)


# ---- a transformers model trained sequence-parallel, from outside its code --------------

IMPLEMENTATION = "tessera_sequence_parallel"
SP_KWARG = "tessera_sequence_parallel"  # the (comm, axis, method) a forward passes down


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function interface: (B, H, T, D) in, (B, T, H, D) out; K/V
    heads repeated for grouped-query attention. Causal by construction (decoders). The
    communicator arrives as a forward keyword (transformers passes a model's extra keywords
    down to its attention function), so no state outside the call says which axis is used."""
    if SP_KWARG not in kwargs:  # called on a whole sequence (not through SequenceParallel)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=True
        )
    comm, axis, method = kwargs[SP_KWARG]
    if scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"sequence-parallel attention uses 1/sqrt(head_dim); the model asks scale {scaling}")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    fn = ring_attention if method == "ring" else ulysses_attention
    out = fn(query, key, value, comm, axis, causal=True)
    return out.transpose(1, 2).contiguous(), None


def sequence_positions(local: int, n: int, rank: int, method: str) -> torch.Tensor:
    """Global positions of the ``local`` tokens rank ``rank`` of ``n`` holds (the layout
    ``sequence_shard`` makes)."""
    full = torch.arange(local * n).unsqueeze(0)
    if method == "ring":
        return zigzag_split(full, n, rank, dim=1)[0]
    return full.chunk(n, dim=1)[rank][0]


def sequence_shard(
    ids: torch.Tensor, n: int, rank: int, method: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (input ids, labels, position ids) of a causal-LM batch (B, T): labels are
    the next tokens, shifted before the split (-100 past the end), so no rank needs its
    neighbour's tokens; Ring takes the zig-zag layout, Ulysses contiguous chunks."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    if method == "ring":
        split = lambda t: zigzag_split(t, n, rank, dim=1)  # noqa: E731
    else:
        if ids.shape[1] % n:
            raise ValueError(f"sequence of {ids.shape[1]} tokens does not split over {n} Ulysses ranks")
        split = lambda t: t.chunk(n, dim=1)[rank]  # noqa: E731
    return split(ids), split(labels), split(positions)


class SequenceParallel:
    """Runs a transformers causal LM with its sequence split over ``axis``: attention swapped
    for Ring or Ulysses through transformers' AttentionInterface (the model code is not
    touched), positions passed explicitly, the loss a sum over every rank's tokens divided
    by their count, parameter gradients summed over the axis (each rank saw part of every
    sequence)."""

    def __init__(self, model, comm: Comm, axis: str = "sp", method: str = "ring"):
        if method not in ("ring", "ulysses"):
            raise ValueError(f"unknown sequence-parallel method {method!r}; choose 'ring' or 'ulysses'")
        self.model, self.comm, self.axis, self.method = model, comm, axis, method
        # Set for good, not per call: activation checkpointing recomputes the layers in
        # backward, after a per-call switch would have been undone. Without the forward's
        # keyword the implementation is plain causal sdpa, so the model still runs whole.
        model.config._attn_implementation = IMPLEMENTATION

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Forward and the global mean next-token loss of the full batch ``ids`` (B, T)."""
        n, me = self.comm.mesh.size(self.axis), self.comm.mesh.rank(self.axis)
        local, labels, positions = sequence_shard(ids, n, me, self.method)
        logits = self.model(
            input_ids=local, position_ids=positions, **{SP_KWARG: (self.comm, self.axis, self.method)}
        ).logits
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        count = torch.tensor(float((labels != -100).sum()), device=total.device)
        self.comm.all_reduce(count, self.axis)
        return _SumOverAxis.apply(total, self.comm, self.axis) / count

    def reduce_gradients(self) -> None:
        """Sum each parameter's gradient over the axis, in one flat all-reduce."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.comm.all_reduce(flat, self.axis)
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p.grad))


class _SumOverAxis(torch.autograd.Function):
    """The loss summed over the axis; backward passes the gradient through unchanged (each
    rank's tokens only reach its own graph, and every rank's loss is the same sum)."""

    @staticmethod
    def forward(ctx, t, comm: Comm, axis: str):
        out = t.detach().clone()
        comm.all_reduce(out, axis)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _hf_attention)


_register()
