"""Sequence-parallel attention for training: Ulysses and Ring, forward and backward, causal
or not, over the ``sp`` axis of a Mesh.

Tensors are (batch, heads, local tokens, head_dim), the sequence split over the axis.

Ulysses trades the sequence split for a head split with one all-to-all (differentiable in
``runtime.comm``: its gradient is the inverse all-to-all), attends over the whole sequence
for its heads, and trades back.

Ring passes K/V blocks round the ring and merges the blocks' results by their
log-sum-exp (online softmax), with the block kernel inference uses
(``tessera.parallel.attention_blocks``). Its backward is written out (``_RingAttention``): the K/V
blocks go round again, each rank adds its queries' contribution to the block's dK/dV, and
the accumulated dK/dV travel with the block until they are back at its owner. For causal
attention the sequence is laid out zig-zag (``zigzag_split``): with 2N chunks, rank r holds
chunks r and 2N-1-r, so every rank does the same work (Brandon et al., Striped / zig-zag
ring attention); a chunk pair is skipped, masked or computed whole by its global positions.

Both honour what a transformers decoder layer asks of its attention function
(``Visibility``): its scale, a sliding window, soft-capped scores, a padding mask over the
keys (the global batch's ``attention_mask``, which every rank holds) and attention sinks.
Anything else a layer passes with a value is refused by name (``_FEATURES``), never ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessera.parallel.attention_blocks import (
    Visibility,
    add_sinks,
    block_backward,
    finite,
    merge_blocks,
    visible_block,
)
from tessera.parallel.lm_batch import next_token_labels, token_batch
from tessera.runtime.comm import Comm

__all__ = ["next_token_labels", "token_batch"]  # re-exported: the batch format SP trains on


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


def _layout(n: int, rank: int, causal: bool, local: int) -> list[range]:
    """Global positions of each contiguous chunk of the ``local`` tokens rank ``rank`` of
    ``n`` holds: the zig-zag pair for causal Ring, one contiguous share otherwise."""
    if n > 1 and causal:
        c = local // 2
        return [range(i * c, (i + 1) * c) for i in (rank, 2 * n - 1 - rank)]
    return [range(rank * local, (rank + 1) * local)]


def _pass(comm: Comm, t: torch.Tensor, axis: str, n: int, me: int) -> torch.Tensor:
    incoming = torch.empty_like(t)
    works = [comm.isend(t, axis, dst=(me + 1) % n), comm.irecv(incoming, axis, src=(me - 1) % n)]
    for w in works:
        w.wait()
    return incoming


def _keys(key_valid: torch.Tensor | None, ks: range):
    return None if key_valid is None else key_valid[:, ks.start : ks.stop]


class _RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over every rank's keys on ``axis`` (``comm`` None:
    over the local keys alone, which are then the whole sequence), as ``vis`` and
    ``key_valid`` say, with optional per-head ``sinks``."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, comm, axis, vis: Visibility, key_valid):
        n, me = (comm.mesh.size(axis), comm.mesh.rank(axis)) if comm is not None else (1, 0)
        mine = _layout(n, me, vis.causal, q.shape[2])
        qs = q.chunk(len(mine), dim=2)
        outs: list = [None] * len(mine)
        lses: list = [None] * len(mine)
        kv = torch.stack([k, v]).contiguous()
        for step in range(n):
            theirs = _layout(n, (me - step) % n, vis.causal, q.shape[2])
            for a, q_pos in enumerate(mine):
                for kb, k_pos in zip(kv.chunk(len(theirs), dim=3), theirs, strict=True):
                    block = visible_block(qs[a], kb[0], kb[1], vis, q_pos, k_pos, _keys(key_valid, k_pos))
                    if block is None:  # every key of the block is masked for these queries
                        continue
                    if outs[a] is None:
                        outs[a], lses[a] = block
                    else:
                        outs[a], lses[a] = merge_blocks(outs[a], lses[a], *block)
            if step < n - 1:
                kv = _pass(comm, kv, axis, n, me)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.comm, ctx.axis, ctx.vis, ctx.key_valid = comm, axis, vis, key_valid
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        comm, axis, vis, key_valid = ctx.comm, ctx.axis, ctx.vis, ctx.key_valid
        n, me = (comm.mesh.size(axis), comm.mesh.rank(axis)) if comm is not None else (1, 0)
        mine = _layout(n, me, vis.causal, q.shape[2])
        parts = len(mine)
        g = grad_out.float()
        delta = (g * out).sum(-1, keepdim=True)  # D = rowsum(dO * O)
        qs, gs, ls, ds = (t.chunk(parts, dim=2) for t in (q.float(), g, lse, delta))
        dq = [torch.zeros_like(c) for c in qs]
        # The block in hand and its dK/dV so far travel together: (k, v, dk, dv).
        zeros = torch.zeros_like(k, dtype=torch.float32)
        block = torch.stack([k.float(), v.float(), zeros, torch.zeros_like(zeros)])
        for step in range(n):
            theirs = _layout(n, (me - step) % n, vis.causal, q.shape[2])
            kb, vb, dkb, dvb = (t.chunk(len(theirs), dim=2) for t in block.unbind(0))
            for a, q_pos in enumerate(mine):
                for b, k_pos in enumerate(theirs):
                    grads = block_backward(
                        qs[a], kb[b], vb[b], gs[a], ls[a], ds[a], vis, q_pos, k_pos, _keys(key_valid, k_pos)
                    )
                    if grads is None:
                        continue
                    dq[a].add_(grads[0])
                    dkb[b].add_(grads[1])
                    dvb[b].add_(grads[2])
            if n > 1:
                block = _pass(comm, block.contiguous(), axis, n, me)  # after n passes: home again
        dsinks = None
        if sinks is not None:  # a sink is a key of value zero: dS = P_sink * (0 - D)
            p_sink = torch.exp(sinks.float().view(1, -1, 1, 1) - finite(lse))
            dsinks = -(p_sink * delta).sum(dim=(0, 2, 3)).to(sinks.dtype)
        dk, dv = block[2], block[3]
        return (
            torch.cat(dq, dim=2).to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            dsinks,
            None,
            None,
            None,
            None,
        )


def _plain(vis: Visibility | None, key_valid, sinks) -> bool:
    return (
        (vis is None or (vis.window is None and vis.softcap is None)) and key_valid is None and sinks is None
    )


def ring_attention(
    q, k, v, comm: Comm, axis: str, *, causal: bool = False, vis: Visibility | None = None,
    key_valid: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of the local queries over every rank's keys on ``axis``; with ``causal``
    the local tokens must be this rank's ``zigzag_split`` share. ``vis`` (scale, window,
    soft-cap; its causality wins over ``causal``), ``key_valid`` (B, T) over the global
    sequence, ``sinks`` (heads,) as ``_hf_attention`` passes them."""
    vis = vis or Visibility(scale=1.0 / math.sqrt(q.shape[-1]), causal=causal)
    if comm.mesh.size(axis) == 1 and _plain(vis, key_valid, sinks):
        return F.scaled_dot_product_attention(q, k, v, is_causal=vis.causal, scale=vis.scale)
    return _RingAttention.apply(
        q, k, v, sinks, comm if comm.mesh.size(axis) > 1 else None, axis, vis, key_valid
    )


def ulysses_attention(
    q, k, v, comm: Comm, axis: str, *, causal: bool = False, vis: Visibility | None = None,
    key_valid: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Ulysses: heads for sequence by one all-to-all, attention over the whole sequence for
    this rank's heads (torch's sdpa when nothing but causality is asked; the blockwise kernel
    with its written-out backward otherwise), and back."""
    heads, n = q.shape[1], comm.mesh.size(axis)
    if heads % n:
        raise ValueError(f"{heads} attention heads are not divisible by the Ulysses degree {axis}={n}")
    vis = vis or Visibility(scale=1.0 / math.sqrt(q.shape[-1]), causal=causal)
    q, k, v = (comm.all_to_all(t, axis, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    if _plain(vis, key_valid, sinks):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=vis.causal, scale=vis.scale)
    else:
        if sinks is not None:  # this rank's heads' sinks (the all-to-all split heads contiguously)
            sinks = sinks.chunk(n)[comm.mesh.rank(axis)]
        out = _RingAttention.apply(q, k, v, sinks, None, axis, vis, key_valid)
    return comm.all_to_all(out, axis, scatter_dim=2, gather_dim=1)


# ---- a transformers model trained sequence-parallel, from outside its code --------------

IMPLEMENTATION = "tessera_sequence_parallel"
SP_KWARG = "tessera_sequence_parallel"  # the SequenceContext a forward passes down


@dataclass(frozen=True)
class SequenceContext:
    """What a forward passes down to every layer's attention: the axis the sequence is split
    over and how, and the global batch's padding mask over the keys (B, T; True = a token)."""

    comm: Comm
    axis: str
    method: str
    key_valid: torch.Tensor | None = None


# Arguments transformers' decoder layers pass to their attention function: honoured here,
# or harmless (nothing the attention computes depends on them). Any other argument with a
# value is refused by name (``_refuse_unknown``).
_HONOURED = {"dropout", "scaling", "sliding_window", "softcap", "s_aux", SP_KWARG}
_HARMLESS = {
    "position_ids",
    "cache_position",
    "use_cache",
    "output_router_logits",
    "cache",
    "past_key_values",
}


def _refuse_unknown(module, kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name in _HONOURED or name in _HARMLESS or value is None or value is False:
            continue
        raise ValueError(
            f"{type(module).__name__} passes {name}={value!r} to its attention function, which Tessera's "
            "sequence-parallel attention does not implement: refused rather than ignored (train this model "
            "without sp)"
        )


def _visibility(module, query, scaling, sliding_window, softcap) -> Visibility:
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return Visibility(scale=float(scale), causal=True, window=sliding_window, softcap=softcap)


def _hf_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
    softcap=None, s_aux=None, **kwargs,
):  # fmt: skip
    """transformers' attention-function interface: (B, H, T, D) in, (B, T, H, D) out; K/V
    heads repeated for grouped-query attention. Causal by construction (decoders). The
    ``SequenceContext`` arrives as a forward keyword (transformers passes a model's extra
    keywords down to its attention function), so no state outside the call says which axis
    is used. Without it (the model run whole, e.g. evaluated after training) the layer's
    own semantics are kept: the mask transformers built (``sdpa_mask``, registered for this
    implementation), window and all."""
    _refuse_unknown(module, kwargs)
    if dropout and module.training:
        raise ValueError(
            f"{type(module).__name__} applies attention dropout {dropout} in training; parallel attention "
            "draws other random masks than one process: set the config's attention_dropout to 0"
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    vis = _visibility(module, query, scaling, sliding_window, softcap)
    context = kwargs.get(SP_KWARG)
    if context is None:
        out = _whole_sequence(query, key, value, attention_mask, vis, s_aux)
    else:
        fn = ring_attention if context.method == "ring" else ulysses_attention
        out = fn(
            query, key, value, context.comm, context.axis, vis=vis, key_valid=context.key_valid, sinks=s_aux
        )
    return out.transpose(1, 2).contiguous(), None


def _whole_sequence(q, k, v, mask, vis: Visibility, sinks):
    """One process, the layer's own semantics: ``mask`` is transformers' boolean
    (B, 1, Tq, Tk) mask (None: plain causal), which carries the window and the padding."""
    if vis.softcap is None and sinks is None:
        causal = mask is None and q.shape[2] > 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=vis.scale)
    # transformers' eager attention: soft-cap, the mask as the most negative float (a row
    # that sees no key is uniform, not NaN), the sinks as an extra column dropped after softmax
    s = (q @ k.transpose(-1, -2)) * vis.scale
    if vis.softcap is not None:
        s = vis.softcap * torch.tanh(s / vis.softcap)
    if mask is None and q.shape[2] > 1:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(
            k.shape[2] - q.shape[2]
        )
    if mask is not None:
        s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s.float(), dim=-1).to(v.dtype)
    return p[..., : k.shape[2]] @ v


def sequence_positions(local: int, n: int, rank: int, method: str) -> torch.Tensor:
    """Global positions of the ``local`` tokens rank ``rank`` of ``n`` holds (the layout
    ``sequence_shard`` makes)."""
    full = torch.arange(local * n).unsqueeze(0)
    if method == "ring":
        return zigzag_split(full, n, rank, dim=1)[0]
    return full.chunk(n, dim=1)[rank][0]


def sequence_shard(
    ids: torch.Tensor, n: int, rank: int, method: str, labels: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (input ids, labels, position ids) of a causal-LM batch (B, T): labels are
    the next tokens (``next_token_labels`` unless given), made before the split, so no rank
    needs its neighbour's tokens; Ring takes the zig-zag layout, Ulysses contiguous chunks."""
    labels = next_token_labels(ids) if labels is None else labels
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    if method == "ring":
        split = lambda t: zigzag_split(t, n, rank, dim=1)  # noqa: E731
    else:
        if ids.shape[1] % n:
            raise ValueError(f"sequence of {ids.shape[1]} tokens does not split over {n} Ulysses ranks")
        split = lambda t: t.chunk(n, dim=1)[rank]  # noqa: E731
    return split(ids), split(labels), split(positions)


def check_sequence_parallel(model) -> None:
    """Refuse, by name, a model whose attention Tessera's sequence-parallel attention would not
    reproduce: a family that does not call transformers' attention interface (its attention
    would run on the local slice alone), or a config feature the kernel does not implement.
    Touches nothing: called before a plan changes the model."""
    cls = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{cls} does not dispatch its attention through transformers' AttentionInterface (e.g. ALiBi "
            "families such as BLOOM, Falcon, MPT): sequence parallel cannot replace it; use sp=1"
        )
    cfg = model.config
    for name, why in _CONFIG_REFUSALS.items():
        value = getattr(cfg, name, None)
        if value not in (None, False, 0):
            raise ValueError(
                f"{cls}: config.{name}={value!r} ({why}) is not implemented under sequence parallel; use sp=1"
            )
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if kinds - {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"{cls}: layer types {sorted(kinds - {'full_attention', 'sliding_attention'})} are not implemented under "
            "sequence parallel (full and sliding attention are); use sp=1"
        )
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(
            f"{cls} is an encoder-decoder model: sequence parallel trains decoder-only causal LMs"
        )


# Config fields that change attention in ways the kernel does not implement.
_CONFIG_REFUSALS = {
    "alibi": "ALiBi position biases",
    "attention_chunk_size": "chunked local attention",
    "use_bidirectional_attention": "bidirectional attention",
}


class SequenceParallel:
    """Runs a transformers causal LM with its sequence split over ``axis``: attention swapped
    for Ring or Ulysses through transformers' AttentionInterface (the model code is not
    touched), positions passed explicitly, the loss a sum over every rank's tokens divided
    by their count, parameter gradients summed over the axis (each rank saw part of every
    sequence)."""

    def __init__(self, model, comm: Comm, axis: str = "sp", method: str = "ring"):
        if method not in ("ring", "ulysses"):
            raise ValueError(f"unknown sequence-parallel method {method!r}; choose 'ring' or 'ulysses'")
        check_sequence_parallel(model)
        self.model, self.comm, self.axis, self.method = model, comm, axis, method
        # Set for good, not per call: activation checkpointing recomputes the layers in
        # backward, after a per-call switch would have been undone. Without the forward's
        # keyword the implementation keeps the layer's own semantics, so the model still runs whole.
        use_sequence_parallel_attention(model)

    def loss(self, batch, *, denominator: float | None = None) -> torch.Tensor:
        """Forward and the loss of the full batch (``token_batch``): the global mean
        next-token loss, or the summed loss over ``denominator`` when given."""
        ids, mask = token_batch(batch)
        n, me = self.comm.mesh.size(self.axis), self.comm.mesh.rank(self.axis)
        local, labels, positions = sequence_shard(ids, n, me, self.method, next_token_labels(ids, mask))
        context = SequenceContext(self.comm, self.axis, self.method, None if mask is None else mask.bool())
        logits = self.model(input_ids=local, position_ids=positions, **{SP_KWARG: context}).logits
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        if denominator is None:
            count = torch.tensor(float((labels != -100).sum()), device=total.device)
            self.comm.all_reduce(count, self.axis)
        else:
            count = denominator
        return _SumOverAxis.apply(total, self.comm, self.axis) / count

    def reduce_gradients(self) -> None:
        """Sum each parameter's gradient over the axis, in one flat all-reduce."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.comm.all_reduce(flat, self.axis)
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p.grad))


def use_sequence_parallel_attention(model) -> None:
    """Every layer's attention through ``_hf_attention`` from now on (the layers look the
    implementation up per call)."""
    model.config._attn_implementation = IMPLEMENTATION


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
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, _hf_attention)
    # the model run whole gets the masks sdpa would (window and padding in one boolean mask)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)


_register()
