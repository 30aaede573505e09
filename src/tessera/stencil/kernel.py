"""Compiled stencils: C from ``codegen`` built by the operator compiler's ``compile_source``
(same flags, same disk cache, same ``CompilerError``s) and called through ctypes on
float32 numpy arrays, their shapes checked first."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field

import numpy as np

from tessera.kernels.compiler import Compiled, compile_source, load
from tessera.stencil.codegen import generate_apply, generate_wave
from tessera.stencil.schedule import StencilSchedule
from tessera.stencil.stencil import Stencil, check_grid, check_inputs, padded_shape

NO_CONTRACTION = ("-ffp-contract=off",)
_LOADED: dict[str, ctypes.CDLL] = {}


def _array(x, what: str) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or not x.flags.c_contiguous:
        got = type(x).__name__ if not isinstance(x, np.ndarray) else f"{x.dtype}, contiguous={x.flags.c_contiguous}"
        raise ValueError(f"{what} must be a C-contiguous float32 numpy array, got {got}")
    return x


def _build(source: str, isa: str, name: str, contract: bool) -> tuple[Compiled, ctypes.CDLL]:
    compiled = compile_source(source, isa=isa, name=name, extra_flags=() if contract else NO_CONTRACTION)
    if compiled.key not in _LOADED:
        _LOADED[compiled.key] = load(compiled)
    return compiled, _LOADED[compiled.key]


def _pointers(stencil: Stencil, coeffs: dict) -> ctypes.Array:
    arr = (ctypes.c_void_p * max(1, len(stencil.arrays)))()
    for i, name in enumerate(stencil.arrays):
        arr[i] = _array(coeffs[name], f"coefficient array {name!r}").ctypes.data
    return arr


@dataclass
class StencilKernel:
    stencil: Stencil
    shape: tuple[int, int, int]
    schedule: StencilSchedule
    compiled: Compiled
    _fn: ctypes._CFuncPtr = field(repr=False)

    def __call__(self, u: np.ndarray, coeffs: dict | None = None, *, out: np.ndarray | None = None,
                 threads: int = 1) -> np.ndarray:
        coeffs = coeffs or {}
        check_inputs(self.stencil, self.shape, u, coeffs)
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        _array(u, "field u")
        if out is None:
            out = np.zeros(u.shape, dtype=np.float32)  # the halo stays zero
        elif tuple(out.shape) != tuple(u.shape):
            raise ValueError(f"out has shape {tuple(out.shape)}; it must match the field's {tuple(u.shape)}")
        _array(out, "out")
        self._fn(ctypes.c_void_p(out.ctypes.data), ctypes.c_void_p(u.ctypes.data), _pointers(self.stencil, coeffs),
                 ctypes.c_int(threads))
        return out

    def time(self, u, coeffs=None, *, threads: int = 1, repeats: int = 5, warmup: int = 1) -> list[float]:
        """Seconds per call (the tuner's interface: ``kernels.tuner.measure_trial``). The output
        is written once before any timed call: a fresh array's pages are mapped on first touch
        (19,000 page faults for a 256^3 field, or a wait for huge-page compaction), which once
        went into the tuner's cold first run and got fast kernels rejected as slow."""
        out = np.empty(u.shape, dtype=np.float32)
        out.fill(0.0)
        for _ in range(warmup):
            self(u, coeffs, out=out, threads=threads)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            self(u, coeffs, out=out, threads=threads)
            times.append(time.perf_counter() - began)
        return times


def compile_stencil(stencil: Stencil, shape, schedule: StencilSchedule | None = None, *,
                    contract: bool = True) -> StencilKernel:
    """The kernel of ``stencil`` over an interior of ``shape`` under ``schedule``;
    ``contract=False`` builds with ``-ffp-contract=off`` (bit-exact with the float32 reference)."""
    shape = check_grid(shape)
    schedule = schedule or StencilSchedule()
    if schedule.time_block != 1:
        raise ValueError(f"time_block={schedule.time_block} applies to the wave kernel only (compile_wave)")
    compiled, lib = _build(generate_apply(stencil, shape, schedule), schedule.isa, "stencil", contract)
    fn = lib.tk_run
    fn.restype = None
    return StencilKernel(stencil, shape, schedule, compiled, fn)


@dataclass
class WaveKernel:
    """``steps`` leapfrog steps of next = 2 cur - prev + stencil(cur), the source's amplitudes
    added at one interior point after each step."""

    stencil: Stencil
    shape: tuple[int, int, int]
    schedule: StencilSchedule
    compiled: Compiled
    _fn: ctypes._CFuncPtr = field(repr=False)

    def run(self, prev: np.ndarray, cur: np.ndarray, coeffs: dict, source: np.ndarray, at: tuple[int, int, int],
            *, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Advance by ``len(source)`` steps in place; returns (previous, current) fields."""
        check_inputs(self.stencil, self.shape, cur, coeffs)
        want = padded_shape(self.shape, self.stencil.halo)
        if tuple(prev.shape) != want:
            raise ValueError(f"previous field has shape {tuple(prev.shape)}; it must be {want}")
        if not all(0 <= a < n for a, n in zip(at, self.shape, strict=True)):
            raise ValueError(f"source position {at} lies outside the interior {self.shape}")
        source = _array(np.ascontiguousarray(source, dtype=np.float32), "source")
        a, b = _array(prev, "previous field"), _array(cur, "current field")
        steps = len(source)
        self._fn(ctypes.c_void_p(a.ctypes.data), ctypes.c_void_p(b.ctypes.data), _pointers(self.stencil, coeffs),
                 ctypes.c_void_p(source.ctypes.data), *(ctypes.c_long(int(c)) for c in at), ctypes.c_long(steps),
                 ctypes.c_int(threads))
        return (a, b) if steps % 2 == 0 else (b, a)


def compile_wave(stencil: Stencil, shape, schedule: StencilSchedule | None = None, *,
                 contract: bool = True) -> WaveKernel:
    shape = check_grid(shape)
    schedule = schedule or StencilSchedule()
    if schedule.rz != 1 or schedule.ry != 1:
        raise ValueError(f"rz={schedule.rz}, ry={schedule.ry}: the wave kernel computes one row at a time; "
                         "use rz=1, ry=1 (row jamming applies to compile_stencil)")
    compiled, lib = _build(generate_wave(stencil, shape, schedule), schedule.isa, "wave", contract)
    fn = lib.tk_wave
    fn.restype = None
    return WaveKernel(stencil, shape, schedule, compiled, fn)
