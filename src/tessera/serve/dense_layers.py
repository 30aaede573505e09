"""An encoder's dense layers on Tessera's kernels (``tessera.kernels.dense``), swapped in from
outside the HF model code for the duration of a forward, as the packed attention is.

Every ``nn.Linear`` of the model runs ``Y = X W^T + b`` on a kernel compiled for its
``N x K`` (the tuner's choice, recorded on disk) with its weight packed once, here; the
token count is whatever the batch brings. Where a family's block ends in
``LayerNorm(dense(h) + x)`` (BERT's and RoBERTa's ``*SelfOutput`` / ``*Output``), the
residual is added in the kernel's epilogue, on the register tile before it is stored, and
the LayerNorm runs in the kernel too, on each block of rows once it is complete (in cache).
An exact-GELU intermediate layer (``dense`` then ``gelu``) runs its GELU in the kernel's
epilogue as well, on the register tile before the store (erf to 1.5e-7; torch's in-place GELU
over the stored output took 2.6% of a BERT-base request of 252 tokens).

Where the runner's attention is Tessera's packed kernel, BERT's and RoBERTa's encoder layers
run whole (`_whole_layer`): Q, K and V from one GEMM on their concatenated weights, the
attention kernel reading its column slices in place, then the three fused blocks above. Their
Q, K and V weights are packed only so, concatenated; anything else reaching such a layer (a
mask) runs its modules, Q, K and V on torch's kernels and the rest on Tessera's.

The layers of one width write into a pool of output buffers (the owner's, one pool per
width): each call takes a buffer that no tensor still holds (checked on the storage's
reference count, so neither the call's own input or residual, which its caller holds, nor an
output that escapes, e.g. a classifier's logits, is ever written over). On this VM a fresh
tensor of a few MiB costs more in page faults than the GEMM that fills it; and one buffer a
layer held twelve of each for a 12-layer encoder (a BERT-base-size one at 500 tokens: 166 MB
of buffers, against 15 MB shared: three of the hidden width, one of each other), and was no
faster (a paired comparison in process; its figures are in the commit that made the pool).

The model object itself is never changed: ``on()`` sets each module's ``forward`` and puts
the old one back on exit, so a model shared with other runners (or a test's reference
forward) runs torch's layers outside the context. Weights are packed when the runner is
built; a model whose weights change afterwards needs a new runner. Engine workers run on
copies of one model: a worker's layers take the packed weights of the first worker's
(``packed_from``) wherever the layer's weight and bias are equal, so N workers hold one
packed copy; only the output buffers are each worker's own.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tessera.kernels.dense import DenseKernel, dense_kernel

KERNELS = ("tessera", "torch")


@dataclass
class _Layer:
    kernel: DenseKernel
    packed: torch.Tensor
    bias: torch.Tensor
    counts: dict[str, int]  # the owner's: calls and rows run on the kernels
    # the owner's output buffers by width N, shared by its layers of that width: each call
    # takes one nothing else holds
    pool: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, layer_norm=None, gelu: bool = False
    ) -> torch.Tensor:
        lead, k, n = x.shape[:-1], self.kernel.k, self.kernel.n
        m = x.numel() // k
        self.counts["calls"] += 1
        self.counts["rows"] += m
        r = None if residual is None else residual.reshape(-1, n)
        y = self.kernel(x.reshape(-1, k), self.packed, self.bias, r, layer_norm=layer_norm, gelu=gelu,
                        out=self._buffer(m), threads=torch.get_num_threads())  # fmt: skip
        return y.view(*lead, n)

    def _buffer(self, m: int) -> torch.Tensor:
        """``m`` rows of an output buffer of the layers' pool for this width that no tensor
        still holds (not the call's input nor its residual, which the caller holds), grown if
        short; else a new one, added to the pool. A fresh multi-MiB tensor costs a page fault per
        4 KiB (1.7 us each here, as much as the GEMM at a few hundred tokens), and a buffer of
        each layer's own held the model's depth times more memory."""
        n = self.kernel.n
        buffers = self.pool.setdefault(n, [])
        free = next((i for i, buf in enumerate(buffers) if not held_elsewhere(buf)), len(buffers))
        if free == len(buffers) or buffers[free].shape[0] < m:
            buffers[free : free + 1] = [torch.empty(m, n)]  # a new one, or the short free one replaced
            self.counts["buffers"] += 1
        return buffers[free][:m]


@contextlib.contextmanager
def swapped_forwards(swaps):
    """Each (module, forward) of ``swaps`` runs ``forward`` as the module's own while inside;
    after, each module has whatever it had before (its class's forward, or an earlier swap)."""
    saved = [(m, m.__dict__.get("forward")) for m, _ in swaps]
    for module, forward in swaps:
        module.__dict__["forward"] = forward
    try:
        yield
    finally:
        for module, previous in saved:
            if previous is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = previous


def held_elsewhere(buffer: torch.Tensor) -> bool:
    """Whether a tensor other than ``buffer`` (a view it returned) shares its storage; the
    query itself holds one reference (the storage object it is asked through)."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) > 2


def _residual_block(module: nn.Module) -> bool:
    """``dense -> dropout -> LayerNorm(. + input_tensor)``: BERT/RoBERTa's attention and
    feed-forward outputs (their forward takes ``hidden_states, input_tensor``)."""
    names = list(inspect.signature(type(module).forward).parameters)
    return (
        names[1:] == ["hidden_states", "input_tensor"]
        and isinstance(getattr(module, "dense", None), nn.Linear)
        and isinstance(getattr(module, "LayerNorm", None), nn.LayerNorm)
        and isinstance(getattr(module, "dropout", None), nn.Dropout)
    )


@dataclass(frozen=True)
class _Packed:
    kernel: DenseKernel
    packed: torch.Tensor
    bias: torch.Tensor
    weight: torch.Tensor  # the weight it was packed from (to check a sharer's is equal)


@dataclass
class DenseLayers:
    """The swaps for one model: ``on()`` runs a forward on Tessera's dense kernels."""

    model: nn.Module
    mode: str = "model"  # the tuner's mode: "model" (predicted best) or "measure" (timed now)
    m_hint: int = 256  # the token count a "measure" tuning times at
    threads: int = 1  # the thread count tuned for (the kernel runs at torch's count when called)
    amx: str = "auto"  # "auto": the AMX kernel where the CPU has it (float32 accuracy); "off": AVX only
    packed_from: DenseLayers | None = None  # another worker's layers, whose packed weights are reused
    # the packed attention of a batch, attend(q, k, v, segments, scaling) -> (T, heads, head_dim):
    # given, BERT's and RoBERTa's encoder layers run whole (see `_whole_layer`)
    attend: Callable | None = None
    swaps: list[tuple[nn.Module, object]] = field(default_factory=list, init=False)
    packed_bytes: int = field(default=0, init=False)
    shared_bytes: int = field(default=0, init=False)  # packed weights taken from ``packed_from``
    by_name: dict[str, _Packed] = field(default_factory=dict, init=False)
    shapes: set[tuple[int, int]] = field(default_factory=set, init=False)
    fused_residuals: int = field(default=0, init=False)
    gelus_fused: int = field(default=0, init=False)
    whole_layers: int = field(default=0, init=False)
    counts: dict[str, int] = field(default_factory=lambda: {"calls": 0, "rows": 0, "buffers": 0}, init=False)
    pool: dict[int, list[torch.Tensor]] = field(default_factory=dict, init=False)  # the layers' output buffers

    def __post_init__(self) -> None:
        modules = list(self.model.named_modules())
        whole = [(name, m) for name, m in modules if self.attend is not None and _encoder_layer(m)]
        # a whole layer's Q, K and V are packed once, concatenated, not each on its own as well
        fused = {id(getattr(m.attention.self, x)) for _, m in whole for x in ("query", "key", "value")}
        layers: dict[nn.Linear, _Layer] = {}
        for name, module in modules:
            if isinstance(module, nn.Linear) and id(module) not in fused:
                layers[module] = self._layer(name, *_weights(module))
        for name, module in whole:
            sa = module.attention.self
            parts = [_weights(x) for x in (sa.query, sa.key, sa.value)]
            w, b = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            qkv = self._layer(f"{name}.attention.self.query+key+value", w, b)
            dense = [layers[m.dense] for m in (module.attention.output, module.intermediate, module.output)]
            self.swaps.append((module, _whole_layer(module, qkv, *dense, self.attend)))
            self.whole_layers += 1
        for _, module in modules:
            if _residual_block(module):
                self.swaps.append((module, _fused_output(module, layers[module.dense])))
                self.fused_residuals += 1
            elif _gelu_block(module):
                self.swaps.append((module, _gelu_fused(layers[module.dense])))
                self.gelus_fused += 1
        for module, layer in layers.items():
            self.swaps.append((module, layer))

    def _layer(self, name: str, w: torch.Tensor, bias: torch.Tensor) -> _Layer:
        if w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(
                f"--kernels tessera runs float32 CPU weights; a Linear here is {w.dtype} on "
                f"{w.device}: use --kernels torch"
            )
        n, k = w.shape
        theirs = self.packed_from.by_name.get(name) if self.packed_from is not None else None
        if theirs is not None and _same(theirs.weight, w) and _same(theirs.bias, bias):
            mine = theirs
            self.shared_bytes += theirs.packed.numel() * 4
        else:
            kernel = dense_kernel(n, k, threads=self.threads, mode=self.mode, m_hint=self.m_hint, amx=self.amx)
            mine = _Packed(kernel, kernel.pack(w.contiguous()), bias, w)
            self.packed_bytes += mine.packed.numel() * 4
        self.by_name[name] = mine
        self.shapes.add((n, k))
        return _Layer(mine.kernel, mine.packed, mine.bias, self.counts, self.pool)

    def on(self):
        return swapped_forwards(self.swaps)

    def describe(self) -> dict:
        return {
            "kernels": "tessera",
            "dense_shapes": sorted(f"{n}x{k}" for n, k in self.shapes),
            "fused_residuals": self.fused_residuals,
            "gelus_fused": self.gelus_fused,
            "whole_layers": self.whole_layers,
            "packed_weights_mib": round(self.packed_bytes / 2**20, 1),
            "shared_packed_weights_mib": round(self.shared_bytes / 2**20, 1),
            "tuning": self.mode,
            # the kernels' instruction sets: "amx" (bf16x6 tiles), "avx512" or "avx2"
            "dense_isas": sorted({p.kernel.schedule.isa for p in self.by_name.values()}),
            "dense_calls": self.counts["calls"],
            "dense_rows": self.counts["rows"],
            "dense_buffers": self.counts["buffers"],
        }


def _weights(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    w = linear.weight.detach()
    bias = (
        linear.bias.detach().contiguous()
        if linear.bias is not None
        else torch.zeros(w.shape[0], dtype=w.dtype)
    )
    return w, bias


def _encoder_layer(module: nn.Module) -> bool:
    """BERT's and RoBERTa's encoder layer: self-attention from ``query``, ``key`` and ``value``
    projections, then the attention's output block, the exact-GELU intermediate block and the
    output block (each as `_residual_block` / `_gelu_block` recognise them)."""
    attention = getattr(module, "attention", None)
    sa = getattr(attention, "self", None)
    parts = (
        getattr(attention, "output", None),
        getattr(module, "intermediate", None),
        getattr(module, "output", None),
    )
    return (
        isinstance(sa, nn.Module)
        and all(isinstance(getattr(sa, n, None), nn.Linear) for n in ("query", "key", "value"))
        and isinstance(getattr(sa, "num_attention_heads", None), int)
        and isinstance(getattr(sa, "attention_head_size", None), int)
        and all(isinstance(p, nn.Module) for p in parts)
        and _residual_block(parts[0])
        and _gelu_block(parts[1])
        and _residual_block(parts[2])
        and not getattr(module, "is_decoder", False)
    )


def _whole_layer(module: nn.Module, qkv: _Layer, attention_output: _Layer, intermediate: _Layer,
                 output: _Layer, attend: Callable):  # fmt: skip
    """The encoder layer as four kernel calls and the packed attention: Q, K and V from one GEMM
    on their concatenated weights (the input read once; Q, K and V are column slices of its
    output, read in place by the attention kernel), then the attention's output projection with
    the residual and LayerNorm fused, the intermediate layer with GELU fused, and the output
    projection with its residual and LayerNorm. Module by module, the same layer went through
    ~10 modules' Python and packed its input for Q, K and V three times (one forward of the
    MiniLM-size encoder, 8 tokens: 5.3 -> 4.7 ms; 256 tokens: about 1% faster). A batch without
    Tessera's attention kernel, or anything else reaching the layer (a mask), runs the modules
    (Q, K and V on torch's kernels: their weights are packed only concatenated)."""
    sa = module.attention.self
    heads, size = sa.num_attention_heads, sa.attention_head_size
    width = heads * size
    scaling = getattr(sa, "scaling", None)
    ln1 = _layer_norm(module.attention.output.LayerNorm)
    ln2 = _layer_norm(module.output.LayerNorm)
    by_modules = type(module).forward

    def forward(hidden_states: torch.Tensor, attention_mask=None, *args, **kwargs) -> torch.Tensor:
        segments = kwargs.get("tessera_segments")
        extra = [*args, *(kwargs.get(name) for name in _LAYER_INPUTS)]  # the encoder passes them as None
        if (
            attention_mask is not None
            or any(x is not None for x in extra)
            or getattr(segments, "kernel", None) is None
        ):
            return by_modules(module, hidden_states, attention_mask, *args, **kwargs)
        t = hidden_states.shape[-2]
        y = qkv(hidden_states).view(t, 3 * width)
        q, k, v = (y[:, i * width : (i + 1) * width].view(t, heads, size) for i in range(3))
        a = attend(q, k, v, segments, scaling).view(hidden_states.shape)
        x = attention_output(a, residual=hidden_states, layer_norm=ln1)
        return output(intermediate(x, gelu=True), residual=x, layer_norm=ln2)

    return forward


# an encoder layer's inputs beyond its hidden states (cross-attention, a cache), each None here
_LAYER_INPUTS = (
    "encoder_hidden_states",
    "encoder_attention_mask",
    "cache",
    "past_key_values",
    "past_key_value",
)


def _layer_norm(norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor, float]:
    return norm.weight.detach(), norm.bias.detach(), norm.eps


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _gelu_block(module: nn.Module) -> bool:
    """``act(dense(h))`` with the exact (erf) GELU: BERT's and RoBERTa's ``*Intermediate``."""
    from transformers.activations import GELUActivation

    act = getattr(module, "intermediate_act_fn", None)
    names = list(inspect.signature(type(module).forward).parameters)
    return (
        names[1:] == ["hidden_states"]
        and isinstance(getattr(module, "dense", None), nn.Linear)
        and type(act) is GELUActivation
        and act.act is nn.functional.gelu
    )


def _gelu_fused(layer: _Layer):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return layer(hidden_states, gelu=True)  # GELU in the kernel's epilogue

    return forward


def _fused_output(module: nn.Module, layer: _Layer):
    ln = _layer_norm(module.LayerNorm)

    def forward(hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        # dropout is the identity in eval mode (the runner refuses a model in training mode);
        # the LayerNorm runs in the kernel, on each block of rows once it is complete
        return layer(hidden_states, residual=input_tensor, layer_norm=ln)

    return forward


__all__ = ["KERNELS", "DenseLayers", "held_elsewhere"]
