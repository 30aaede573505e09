"""Packed variable-length attention for serving (``csrc/tessera_attention.c``): each input of
a batch attends to itself only, every head, with no padding and no per-input Python loop.

``attention(q, k, v, offsets, scale)`` takes (T, H, D) tensors whose rows are the batch's
tokens end to end (the layout a projection writes before it is viewed as heads) and the
inputs' row offsets; it returns (T, H, D). The kernel is compiled per head size ``D`` (a
multiple of the vector length: 16 floats with AVX-512, 8 with AVX2) and ISA; ``supports``
says whether a head size has one. The softmax's exp is the kernel's own (a Taylor series
after range reduction, ~2e-7 relative), so results match torch's SDPA to fp32 rounding,
not bit for bit; tests bound the difference against a float64 reference.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from functools import cache

import torch
from torch import Tensor

from tessera.kernels.compiler import CSRC, Compiled, compile_source, load
from tessera.kernels.machine import load_machine
from tessera.kernels.schedule import ISAS

SOURCE = CSRC / "tessera_attention.c"


def _isa() -> str:
    machine = load_machine()
    return "avx512" if "avx512" in machine.peak_flops else "avx2"


def supports(head_dim: int, isa: str | None = None) -> bool:
    """Whether the kernel takes heads of ``head_dim`` floats built for ``isa`` (default: the
    widest this machine runs)."""
    return head_dim > 0 and head_dim % ISAS[isa or _isa()][0] == 0


@dataclass
class AttentionKernel:
    head_dim: int
    isa: str
    compiled: Compiled
    _lib: ctypes.CDLL = field(repr=False)

    def __post_init__(self) -> None:
        fn = self._lib.tk_attention
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 6 + [ctypes.c_float, ctypes.c_int]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, scale: float, *,
                 out: Tensor | None = None, threads: int = 1) -> Tensor:  # fmt: skip
        """(T, H, D) q, k, v (rows at any stride, each row's heads contiguous: read in place,
        else copied); ``offsets``: int64 (inputs + 1,) from 0 to T."""
        t, h, d = q.shape
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.shape != (t, h, d) or x.dtype != torch.float32 or x.device.type != "cpu":
                raise ValueError(f"attention: {name} is {tuple(x.shape)} {x.dtype} on {x.device}; "
                                 f"expected ({t}, {h}, {d}) float32 on the CPU")  # fmt: skip
        if d != self.head_dim:
            raise ValueError(f"attention: heads of {d} floats; this kernel is compiled for {self.head_dim}")
        if (
            offsets.dtype != torch.int64
            or offsets.dim() != 1
            or int(offsets[0]) != 0
            or int(offsets[-1]) != t
        ):
            raise ValueError(
                f"attention: offsets must be int64 from 0 to {t} (the tokens), got {offsets.tolist()}"
            )
        (q, ldq), (k, ldk), (v, ldv) = (_rows(x) for x in (q, k, v))
        offsets = offsets.contiguous()
        if out is None:
            out = torch.empty(t, h, d)
        elif out.shape != (t, h, d) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(
                f"attention: out is {tuple(out.shape)} {out.dtype}; expected a contiguous ({t}, {h}, {d}) float32"
            )
        if t:
            self._lib.tk_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), offsets.data_ptr(),
                                   offsets.numel() - 1, h, ldq, ldk, ldv, h * d, scale, threads)  # fmt: skip
        return out


def _rows(x: Tensor) -> tuple[Tensor, int]:
    """``x`` (T, H, D) and its row stride, as the kernel reads it: each row's heads contiguous
    (a column slice of a fused Q/K/V projection's output is read in place), else a copy."""
    t, h, d = x.shape
    if (h == 1 or x.stride(1) == d) and (d == 1 or x.stride(2) == 1) and (t == 1 or x.stride(0) >= h * d):
        return x, x.stride(0) if t > 1 else h * d
    return x.contiguous(), h * d


@cache
def attention_kernel(head_dim: int, isa: str | None = None) -> AttentionKernel:
    """The kernel for heads of ``head_dim`` floats, built for ``isa`` (default: the widest this
    machine runs; ``"avx2"`` on an AVX-512 machine builds the 8-wide variant, as tests do)."""
    isa = isa or _isa()
    if isa not in ISAS:
        raise ValueError(f"attention: isa {isa!r}; choose one of {', '.join(ISAS)}")
    if not supports(head_dim, isa):
        raise ValueError(f"attention: no kernel for heads of {head_dim} floats on {isa} "
                         f"(a multiple of {ISAS[isa][0]} is needed)")  # fmt: skip
    source = (
        f"#define TK_VEC {512 if isa == 'avx512' else 256}\n#define TK_D {head_dim}\n" + SOURCE.read_text()
    )
    compiled = compile_source(source, isa=isa, name=f"attention_d{head_dim}")
    return AttentionKernel(head_dim, isa, compiled, load(compiled))


def reference(q: Tensor, k: Tensor, v: Tensor, offsets: list[int], scale: float) -> Tensor:
    """The plain float64 semantics: softmax(scale Q K^T) V within each input and head."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        qs, ks, vs = (x[a:b].double().transpose(0, 1) for x in (q, k, v))  # (H, n, D)
        out[a:b] = (torch.softmax(scale * qs @ ks.transpose(1, 2), dim=-1) @ vs).transpose(0, 1)
    return out


__all__ = ["AttentionKernel", "attention_kernel", "reference", "supports"]
