"""Unpadded batching, applied from outside the HF model code (TurboTransformers' "smart
batching", section 4.2): the batch's inputs are concatenated into one row of T tokens, so
every dense layer (embeddings, Q/K/V/output projections, feed-forward, layer norms) runs
on exactly the real tokens, and only attention sees the request boundaries. The model
class is used as loaded; the runner passes each token's position within its own input
and swaps in an attention function through transformers' `AttentionInterface` for the
duration of the call (as `tessera.diffusion` swaps attention kernels), which splits at the
boundaries in one of three ways:

- ``per_request``: one fused SDPA call per input on its own slice of Q/K/V (no padding
  anywhere);
- ``padded``: gather Q/K/V into (inputs, heads, longest, head_dim) with a key mask, one
  SDPA call, scatter back (padding inside attention only: TurboTransformers' layout);
- ``nested``: torch's jagged nested tensors through SDPA (on CPU torch runs it input by
  input inside; kept for devices where it has a fused kernel).

What each self-attention layer brings is honoured or refused by name: its softmax scale
(``scaling``) is used by every split; causal layers (``config.is_decoder``) and a model in
training mode (attention dropout) are refused when the runner is built; a mask, dropout, a
causal flag, a sliding window, a logit cap or attention sinks reaching the attention function
are refused at the layer (the served families bring none of them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from tessera.kernels.attention import attention_kernel, supports
from tessera.serve.dense_layers import KERNELS, DenseLayers, held_elsewhere, swapped_forwards
from tessera.serve.model import ServedModel
from tessera.serve.runner import Runner

IMPLEMENTATION = "tessera_packed"
ATTENTION_MODES = ("per_request", "padded", "nested")


@dataclass
class Segments:
    """Where each input lies in the packed row, built once per batch."""

    offsets: list[int]  # len B + 1, offsets[0] = 0, offsets[-1] = T
    mode: str
    gather: torch.Tensor | None = None  # padded: (B, longest) packed row each slot reads
    valid: torch.Tensor | None = None  # padded: (B, longest) bool
    unpack: torch.Tensor | None = None  # padded: (T,) slot of each token in the flat B x longest
    bias: torch.Tensor | None = None  # padded, math: (B, 1, longest) 0 or -inf, the key mask as a bias
    math: bool = False  # padded: attention as matmul + softmax head by head (every op has out=)
    jagged_offsets: torch.Tensor | None = None
    starts: torch.Tensor | None = None  # (B,) row of each input's first token
    # per_request on Tessera's attention kernel: the kernel, the offsets as a tensor, and the
    # runner's buffers (the attention output's, reused while nothing else holds it)
    kernel: object | None = None
    offsets_tensor: torch.Tensor | None = None
    buffers: dict | None = None

    @classmethod
    def build(cls, lengths: list[int], mode: str, *, math: bool = False) -> Segments:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        seg = cls(offsets, mode, math=math, starts=torch.tensor(offsets[:-1]))
        if mode == "padded":
            longest = max(lengths)
            slot = torch.arange(longest)
            length = torch.tensor(lengths)[:, None]
            seg.valid = slot[None] < length
            first = seg.starts[:, None]  # padding slots read their input's first token (masked out as keys)
            seg.gather = torch.where(seg.valid, first + slot, first)
            seg.unpack = seg.valid.flatten().nonzero().flatten()
            seg.bias = torch.zeros(len(lengths), 1, longest).masked_fill(
                ~seg.valid[:, None, :], float("-inf")
            )
        elif mode == "nested":
            seg.jagged_offsets = torch.tensor(offsets)
        return seg


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function HF's self-attention layers call: (1, H, T, D) packed Q/K/V in,
    (1, T, H, D) out. Without this batch's segments (any other caller), plain SDPA."""
    seg: Segments | None = kwargs.get("tessera_segments")
    if seg is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
        return out.transpose(1, 2), None
    _refuse_unhonoured(module, attention_mask, dropout, kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    if seg.kernel is not None:
        out = _on_kernel(q, k, v, seg, scaling)
    elif seg.mode == "per_request":
        out = _per_request(q, k, v, seg.offsets, scaling)
    elif seg.mode == "padded":
        out = _padded(q, k, v, seg, scaling)
    else:
        out = _nested(q, k, v, seg, scaling)
    return out[None], None


# Attention-function keywords of transformers layers that change what attention computes.
_LAYER_FEATURES = {
    "sliding_window": "a sliding window",
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "position_bias": "a position bias",
}


def _refuse_unhonoured(module, attention_mask, dropout, kwargs) -> None:
    """What the splits below do not compute, named with the layer (the runner's build-time
    checks keep the served families from bringing any of it)."""
    found = [text for key, text in _LAYER_FEATURES.items() if kwargs.get(key) is not None]
    if attention_mask is not None:
        found.append("an attention mask")
    if dropout:
        found.append(f"attention dropout {dropout}")
    if getattr(module, "is_causal", False):
        found.append("causal attention")
    if found:
        layer = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
        raise ValueError(
            f"{layer} brings {', '.join(found)}, which the unpadded runner's attention does not "
            "compute; serve this model with the padded runner"
        )


def check_served_model(served: ServedModel) -> None:
    """Refuse, when the runner is built, what its attention would not compute."""
    name = type(served.model).__name__
    if getattr(served.config, "is_decoder", False):
        raise ValueError(
            f"{name} has config.is_decoder=True (causal self-attention); the unpadded runner attends "
            "bidirectionally within each input: serve it with the padded runner"
        )
    if served.model.training:
        raise ValueError(
            f"{name} is in training mode (dropout in attention and between layers); call model.eval() "
            "before serving it"
        )


def _per_request(q, k, v, offsets, scaling) -> torch.Tensor:
    parts = []
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        # (1, H, n, D): CPU's fused (flash) kernel takes 4-D inputs only; 3-D falls back to
        # the unfused math path (bmm, softmax, bmm), measured 1.5x slower on MiniLM.
        piece = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        parts.append(F.scaled_dot_product_attention(*piece, scale=scaling)[0].transpose(0, 1))
    return torch.cat(parts)


def _on_kernel(q, k, v, seg: Segments, scaling) -> torch.Tensor:
    """Every input and head in one call of Tessera's packed attention kernel, its output in the
    runner's buffer (a fresh multi-MiB tensor a layer costs page faults: see dense_layers)."""
    t, h, d = q.shape
    buf = seg.buffers.get("attention")
    if buf is None or buf.numel() < q.numel() or held_elsewhere(buf):
        buf = seg.buffers["attention"] = torch.empty(max(q.numel(), 0 if buf is None else buf.numel()))
    scale = d**-0.5 if scaling is None else scaling  # SDPA's default when the layer brings none
    out = buf[: q.numel()].view(t, h, d)
    return seg.kernel(q, k, v, seg.offsets_tensor, scale, out=out, threads=torch.get_num_threads())


def _padded(q, k, v, seg: Segments, scaling) -> torch.Tensor:
    def gather(t):  # (T, H, D) -> (B, H, longest, D)
        return t[seg.gather].transpose(1, 2)

    qg, kg, vg = gather(q), gather(k), gather(v)
    if seg.math:
        out = _math_heads(qg, kg, vg, seg.bias, scaling)  # (B, longest, H, D), contiguous
    else:
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=seg.valid[:, None, None, :], scale=scaling)
        out = out.transpose(1, 2)
    b, n, h, d = out.shape
    return out.reshape(b * n, h, d).index_select(0, seg.unpack)  # back in packed order


def _math_heads(q, k, v, bias, scaling) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v one head at a time: (B, L, L) scores for one head
    live at once, and every op has an out= overload (so the memory plan can place it)."""
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    heads = []
    for h in range(q.shape[1]):
        scores = torch.baddbmm(bias, q[:, h], k[:, h].transpose(1, 2), alpha=scale)
        heads.append(torch.bmm(torch.softmax(scores, dim=-1), v[:, h]))
    return torch.stack(heads, dim=2)  # (B, L, H, D): the packed order's layout, so no copy after


def _nested(q, k, v, seg: Segments, scaling) -> torch.Tensor:
    def jag(t):
        return torch.nested.nested_tensor_from_jagged(t, offsets=seg.jagged_offsets).transpose(1, 2)

    out = F.scaled_dot_product_attention(jag(q), jag(k), jag(v), scale=scaling)
    return out.transpose(1, 2).values()


AttentionInterface.register(IMPLEMENTATION, packed_attention)


@contextlib.contextmanager
def packed_attention_on(model):
    """The model's layers call `packed_attention` inside; its own choice is restored after."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = before


def _pooler_skipped(encoder):
    """The encoder's pooler (dense + tanh of packed token 0, the first input's alone) returns
    None while the packed batch runs: its output is never read (a classification head pools
    each input's first token itself), and it cost a dense call and a tanh every forward."""
    parts = [m for m in (getattr(encoder, "pooler", None), getattr(encoder, "pooler_activation", None))
             if isinstance(m, nn.Module)]  # fmt: skip
    return swapped_forwards([(m, _nothing) for m in parts])


def _nothing(*args, **kwargs) -> None:
    return None


@dataclass
class Packed:
    ids: torch.Tensor  # (1, T)
    positions: torch.Tensor  # (1, T)
    segments: Segments
    lengths: torch.Tensor  # (B,)
    segment_of_token: torch.Tensor  # (T,) the input each packed token belongs to


class UnpaddedRunner(Runner):
    """``memory_plan=True`` runs each forward inside `arena.Arena` (TurboTransformers'
    length-aware plan); it needs an op sequence that does not depend on the batch, so
    attention is the ``padded`` split computed head by head."""

    padded = False
    name = "unpadded"

    def __init__(
        self,
        served: ServedModel,
        *,
        attention: str = "per_request",
        memory_plan: bool = False,
        kernels: str = "torch",
        tuning: str = "model",
        dense_from: UnpaddedRunner | None = None,
        amx: str = "auto",
    ):
        """``dense_from``: another runner on a copy of the same model (an engine worker's), whose
        packed dense weights this one reuses where they are equal."""
        super().__init__(served)
        check_served_model(served)
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {attention!r}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
        if memory_plan and kernels == "tessera":
            raise ValueError(
                "the memory plan traces ATen ops and Tessera's dense kernels run outside ATen: "
                "use --kernels torch with --memory-plan"
            )
        self.attention_kernel, self.buffers = None, {}
        head_dim = served.config.hidden_size // served.config.num_attention_heads
        if kernels == "tessera" and attention == "per_request" and supports(head_dim):
            self.attention_kernel = attention_kernel(head_dim)
        self.dense = (
            DenseLayers(served.model, mode=tuning, threads=torch.get_num_threads(), amx=amx,
                        packed_from=dense_from.dense if dense_from is not None else None,
                        attend=_on_kernel if self.attention_kernel is not None else None)  # fmt: skip
            if kernels == "tessera"
            else None
        )
        if memory_plan and attention != "padded":
            raise ValueError(
                f"the memory plan needs attention 'padded' (one op sequence for every batch), got {attention!r}"
            )
        self.attention = attention
        self.position_offset = served.family.position_offset(served.config)
        self.arena = None
        self.memory_plan = memory_plan  # set before the arena traces prepare/compute
        if memory_plan:
            from tessera.serve.arena import Arena

            self.arena = Arena(self.prepare, self.compute)

    def describe(self) -> dict:
        kernels = self.dense.describe() if self.dense is not None else {"kernels": "torch"}
        kernels["attention_kernel"] = "tessera" if self.attention_kernel is not None else "torch sdpa"
        return {
            "name": self.name,
            "attention": self.attention,
            "memory_plan": self.arena is not None,
            **kernels,
        }

    def prepare(self, sequences: list[list[int]]) -> Packed:
        lengths = [len(s) for s in sequences]
        seg = Segments.build(lengths, self.attention, math=self.memory_plan)
        if self.attention_kernel is not None:
            seg.kernel, seg.offsets_tensor, seg.buffers = (
                self.attention_kernel,
                torch.tensor(seg.offsets),
                self.buffers,
            )
        ids = torch.tensor([t for s in sequences for t in s])[None]
        length = torch.tensor(lengths)
        starts = torch.tensor(seg.offsets[:-1]).repeat_interleave(length)
        positions = (torch.arange(seg.offsets[-1]) - starts + self.position_offset)[None]
        return Packed(ids, positions, seg, length, torch.arange(len(lengths)).repeat_interleave(length))

    def hidden_states(self, packed: Packed) -> torch.Tensor:
        """(T, hidden) of the packed batch."""
        with packed_attention_on(self.served.model), _pooler_skipped(self.served.encoder):
            out = self.served.encoder(input_ids=packed.ids, position_ids=packed.positions,
                                      tessera_segments=packed.segments)  # fmt: skip
        return out.last_hidden_state[0]

    def compute(self, packed: Packed) -> torch.Tensor:
        with self.dense.on() if self.dense is not None else contextlib.nullcontext():
            return self._compute(packed)

    def _compute(self, packed: Packed) -> torch.Tensor:
        hidden = self.hidden_states(packed)
        first = hidden.index_select(0, packed.segments.starts)
        served = self.served
        if served.task == "classify":
            return served.family.head(served.model, first)
        if served.pooling == "cls":
            return first
        if self.memory_plan:  # an op the arena's trace knows
            return torch.segment_reduce(hidden, "mean", lengths=packed.lengths, axis=0)
        # each input's rows summed in order, then divided by its length: segment_reduce's bits,
        # in 13-16 us instead of 60-110 (1-40 inputs, hidden 384)
        sums = hidden.new_zeros(len(packed.lengths), hidden.shape[1]).index_add_(0, packed.segment_of_token, hidden)
        return sums / packed.lengths[:, None]

    def forward(self, sequences: list[list[int]]) -> torch.Tensor:
        if self.arena is not None:
            return self.arena.run(sequences)
        return self.compute(self.prepare(sequences))
