"""Dense layers for serving: ``Y = X W^T + bias (+ R)`` on Tessera's micro-kernel, with the
weight packed once and the row count ``M`` (a batch's tokens) given at each call.

The operator compiler builds every other kernel for exact shapes; a server sees a new token
count in nearly every batch, so this kernel fixes only what the model fixes (``N``, ``K``)
and takes ``M`` at run time (``csrc/tessera_dense.c``). Its register tile and cache blocks
come from the GEMM tuner's space: ``dense_kernel(..., mode="model")`` takes the analytic
model's pick for an ``m_hint x N x K`` GEMM; ``mode="measure"`` compiles the model's
shortlist as dense kernels, times them at ``m_hint`` rows, times the three fastest again in
interleaved rounds (``tuner.final_rounds``) and keeps the fastest, recorded on disk beside
the GEMM tuner's choices (a restart does not re-tune).

On a CPU with AMX-BF16 (``amx="auto"``, the default) the kernel is ``csrc/tessera_amx.h``
instead: float32 accuracy from six bfloat16 tile products a product (each float split into
three bfloat16 parts; see that file), at about 1.5x the AVX-512 kernel's speed from 32 rows
up. ``mode="model"`` takes it with its default blocks wherever it runs; ``mode="measure"``
times its block choices beside the AVX shortlist and keeps the fastest of them all.
``amx="off"`` keeps to the AVX kernels (e.g. to compare them).

Results do not depend on ``M`` or on the thread count: each output is reduced over K in one
fixed order (KC blocks in order), so a request computes the same bits alone or in a batch.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import cache

import torch
from torch import Tensor

from tessera.kernels import ops
from tessera.kernels.amx import AMX_FLAGS, amx_ready, amx_source
from tessera.kernels.compiler import CSRC, Compiled, compile_source, load
from tessera.kernels.kernel import aligned_empty
from tessera.kernels.machine import load_machine
from tessera.kernels.schedule import GemmSchedule, schedule_from_dict
from tessera.kernels.tuner import MODES, Trial, final_rounds, rank, save_choice, saved_choice, shortlist

SOURCE = CSRC / "tessera_dense.c"
AMX_CHOICES = ("auto", "off")


@dataclass(frozen=True)
class AmxSchedule:
    """The AMX dense kernel's blocks: ``mb`` rows of X and ``kc`` of K at a time (their three
    bfloat16 planes stay in L2 while every column tile of W passes)."""

    mb: int = 256
    kc: int = 768
    kind: str = field(default="amx_dense", init=False)
    isa: str = field(default="amx", init=False)

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def short(self) -> str:
        return f"amx bf16x6 mb{self.mb} kc{self.kc}"


def amx_schedules(k: int) -> list[AmxSchedule]:
    """The AMX blocks the measured tuning times: the default first (the model mode's pick)."""
    kcs = dict.fromkeys(min(k, kc) for kc in (768, 384, 1536))
    return [AmxSchedule(256, kc) for kc in kcs] + [AmxSchedule(128, min(k, 768))]


@dataclass(frozen=True)
class DenseOp:
    """What the tuner's on-disk record is keyed by (``signature``), for a dense layer."""

    n: int
    k: int
    m_hint: int
    amx: bool = False  # the AMX kernel among the candidates

    def signature(self) -> str:
        # x=in-place: choices timed on the kernel that packed all of X per call (no such tag)
        # are not measurements of this one, which reads X in place; they are timed again
        return f"dense|n={self.n}|k={self.k}|m_hint={self.m_hint}|x=in-place" + ("|amx" if self.amx else "")


def source(n: int, k: int, s: GemmSchedule | AmxSchedule) -> str:
    if isinstance(s, AmxSchedule):
        return amx_source(n, k, s.kc, s.mb)
    kc = min(s.kc, k)
    defines = {
        "TK_VEC": 512 if s.isa == "avx512" else 256,
        "TK_MR": s.mr,
        "TK_NR": s.nr,
        "TK_UNROLL": s.unroll,
        "TK_N": n,
        "TK_K": k,
        "TK_KC": kc,
        "TK_MC": s.mc,
    }
    head = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    return head + SOURCE.read_text()


@dataclass
class DenseKernel:
    n: int
    k: int
    schedule: GemmSchedule | AmxSchedule
    compiled: Compiled
    _lib: ctypes.CDLL = field(repr=False)

    def __post_init__(self) -> None:
        self._lib.tk_packed_floats.restype = ctypes.c_long
        self._lib.tk_pack_weight.restype = None
        self._lib.tk_dense.restype = None
        self._lib.tk_dense.argtypes = [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 6 + [
            ctypes.c_float, ctypes.c_int, ctypes.c_int]  # fmt: skip
        self.packed_floats = int(self._lib.tk_packed_floats())

    def pack(self, weight: Tensor) -> Tensor:
        """``weight`` (N x K, torch Linear's layout) in the kernel's packed layout."""
        w = _checked(weight, "weight", (self.n, self.k))
        # a numpy buffer: numpy asks Linux for huge pages for its large arrays (this machine's
        # transparent huge pages are opt-in), and the kernel walks the packed weight in tiles
        # far apart (AMX layers of BERT-base size at 256 rows 1.03-1.07x on them; a probe)
        packed = torch.from_numpy(aligned_empty(self.packed_floats))
        self._lib.tk_pack_weight(ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(packed.data_ptr()))
        return packed

    def __call__(
        self,
        x: Tensor,
        packed: Tensor,
        bias: Tensor,
        residual: Tensor | None = None,
        *,
        layer_norm: tuple[Tensor, Tensor, float] | None = None,
        gelu: bool = False,
        out: Tensor | None = None,
        threads: int = 1,
    ) -> Tensor:
        """``x`` (M x K) @ W^T + ``bias`` (+ ``residual``, M x N), then GELU (erf form) of each
        value when ``gelu``, or LayerNorm over each row when ``layer_norm`` = (weight, bias,
        eps) is given; ``packed`` from ``pack``."""
        if x.dim() != 2:
            raise ValueError(f"dense: x must be 2-D (tokens x {self.k}), got shape {tuple(x.shape)}")
        m = x.shape[0]
        x = _checked(x, "x", (m, self.k))
        bias = _checked(bias, "bias", (self.n,))
        if packed.numel() != self.packed_floats or packed.dtype != torch.float32:
            raise ValueError(
                f"dense: packed weight has {packed.numel()} {packed.dtype}; pack() gives "
                f"{self.packed_floats} float32 for N={self.n}, K={self.k}"
            )
        r = None if residual is None else _checked(residual, "residual", (m, self.n))
        if out is None:
            out = torch.empty(m, self.n, dtype=torch.float32)
        else:
            out = _checked(out, "out", (m, self.n))
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"dense: threads must be an int >= 1, got {threads!r}")
        if gelu and layer_norm is not None:
            raise ValueError("dense: gelu=True and layer_norm together; an encoder's layer has one or the other")
        gamma = beta = None
        eps = 0.0
        if layer_norm is not None:
            gamma, beta, eps = layer_norm
            gamma, beta = (
                _checked(gamma, "layer_norm weight", (self.n,)),
                _checked(beta, "layer_norm bias", (self.n,)),
            )
        if m:
            self._lib.tk_dense(
                x.data_ptr(),
                m,
                packed.data_ptr(),
                bias.data_ptr(),
                None if r is None else r.data_ptr(),
                out.data_ptr(),
                None if gamma is None else gamma.data_ptr(),
                None if beta is None else beta.data_ptr(),
                float(eps),
                int(bool(gelu)),
                threads,
            )
        return out

    def time(self, m: int, *, threads: int = 1, repeats: int = 5, seed: int = 0) -> list[float]:
        """Seconds per call at ``m`` rows on random data (after one untimed call)."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(m, self.k, generator=g)
        packed = self.pack(torch.randn(self.n, self.k, generator=g))
        bias, out = torch.zeros(self.n), torch.empty(m, self.n)
        self(x, packed, bias, out=out, threads=threads)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            self(x, packed, bias, out=out, threads=threads)
            times.append(time.perf_counter() - began)
        return times


def _checked(t: Tensor, name: str, shape: tuple[int, ...]) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"dense: {name} must be a torch.Tensor, not {type(t).__name__}")
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"dense: {name} is {t.dtype} on {t.device}; the kernel takes float32 on the CPU")
    if tuple(t.shape) != shape:
        raise ValueError(f"dense: {name} has shape {tuple(t.shape)}; expected {shape}")
    return t.contiguous()


@cache
def _build(n: int, k: int, schedule: GemmSchedule | AmxSchedule) -> DenseKernel:
    amx = isinstance(schedule, AmxSchedule)
    compiled = compile_source(source(n, k, schedule), isa="avx512" if amx else schedule.isa,
                              name=f"dense_{'amx_' if amx else ''}{n}x{k}", extra_flags=AMX_FLAGS if amx else ())  # fmt: skip
    return DenseKernel(n, k, schedule, compiled, load(compiled))


def _schedule(data: dict) -> GemmSchedule | AmxSchedule:
    if data.get("kind") == "amx_dense":
        return AmxSchedule(data["mb"], data["kc"])
    return schedule_from_dict(data)


def dense_kernel(
    n: int, k: int, *, threads: int = 1, mode: str = "model", m_hint: int = 256, top_k: int = 4, amx: str = "auto"
) -> DenseKernel:
    """The dense kernel for an ``N x K`` weight: the recorded choice if there is one, else the
    model's pick (``model``) or the fastest of the model's shortlist timed now (``measure``).
    ``amx="auto"``: the AMX kernel where this CPU has it (see the module's docstring)."""
    if mode not in MODES:
        raise ValueError(f"tuning mode {mode!r}; choose one of {', '.join(MODES)}")
    if amx not in AMX_CHOICES:
        raise ValueError(f"dense_kernel: amx={amx!r}; choose one of {', '.join(AMX_CHOICES)}")
    for name, value in (("n", n), ("k", k), ("m_hint", m_hint)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"dense_kernel: {name} must be a positive int, got {value!r}")
    machine = load_machine()
    with_amx = amx == "auto" and amx_ready() is None
    key = DenseOp(n, k, m_hint, with_amx)
    entry = saved_choice(key, threads, machine)
    if entry and (mode == "model" or entry["mode"] == "measure"):
        return _build(n, k, _schedule(entry["schedule"]))
    # the dense kernel takes only the tile, mc and kc from a schedule (it reads X in place and
    # W prepacked): of schedules that differ in nothing else, the best ranked stands for all
    trials, seen = [], set()
    for t in rank(ops.gemm(m_hint, n, k, trans_b=True), threads=threads, machine=machine):
        s = t.schedule
        if _dense_loops(s, n, threads) and (s.isa, s.mr, s.nr, s.mc, s.kc, s.unroll) not in seen:
            seen.add((s.isa, s.mr, s.nr, s.mc, s.kc, s.unroll))
            trials.append(t)
    if mode == "model":
        best = amx_schedules(k)[0] if with_amx else trials[0].schedule
    else:
        picked = shortlist(trials, top_k)
        if with_amx:
            picked += [Trial(s, float("nan")) for s in amx_schedules(k)]
        kernels = [_build(n, k, t.schedule) for t in picked]
        for t, kernel in zip(picked, kernels, strict=True):
            t.times = kernel.time(m_hint, threads=threads, repeats=5)
            t.measured = statistics.median(t.times)
        # X comes from torch (on a cache line) and W is packed by the kernel: one placement
        best = final_rounds(
            picked, lambda i, _: statistics.median(kernels[i].time(m_hint, threads=threads, repeats=5)), rounds=3
        ).schedule
    save_choice(key, threads, machine, best, mode)
    return _build(n, k, best)


def _dense_loops(s, n: int, threads: int) -> bool:
    """Is ``s`` a schedule of the dense kernel's own loops (blocks of rows of X, k blocks, all of
    W's panels with its micro-panel held across the rows: ic,pc,jc | jr,ir, nc = N, threads
    over W's panels)? It takes only the tile and mc, kc from a schedule, so the model ranks
    the ones whose loops it runs."""
    return (isinstance(s, GemmSchedule) and s.order == "ic,pc,jc" and s.inner == "jr,ir" and s.nc >= n
            and (threads == 1 or s.parallel == "jr"))


def reference(
    x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor | None = None,
    layer_norm: tuple[Tensor, Tensor, float] | None = None, gelu: bool = False,
) -> Tensor:  # fmt: skip
    """The plain float64 semantics the kernel is tested against."""
    y = x.double() @ weight.double().T + bias.double()
    y = y if residual is None else y + residual.double()
    if gelu:
        y = torch.nn.functional.gelu(y)  # the erf form, in float64
    if layer_norm is not None:
        gamma, beta, eps = layer_norm
        y = torch.nn.functional.layer_norm(y, (y.shape[-1],), gamma.double(), beta.double(), eps)
    return y


__all__ = ["DenseKernel", "DenseOp", "dense_kernel", "reference"]
