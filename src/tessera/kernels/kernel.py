"""A compiled operator: generate C for (operator, schedule), compile it (cached), load it with
ctypes, and call it on numpy arrays or torch tensors with their shapes and dtypes checked."""

from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass, field

import numpy as np

from tessera.kernels.codegen_gemm import generate_gemm, prepackable
from tessera.kernels.codegen_loops import generate_loops
from tessera.kernels.compiler import Compiled, compile_source, load
from tessera.kernels.contraction import analyse
from tessera.kernels.direct import extra_flags, generate_direct
from tessera.kernels.ir import Operator, Tensor
from tessera.kernels.schedule import DirectSchedule, GemmSchedule, LoopSchedule, Schedule, WinogradSchedule

_LOADED: dict[str, Kernel] = {}


def generate(op: Operator, schedule: Schedule) -> str:
    if isinstance(schedule, GemmSchedule):
        return generate_gemm(op, schedule)
    if isinstance(schedule, LoopSchedule):
        return generate_loops(op, schedule)
    if isinstance(schedule, DirectSchedule):
        return generate_direct(op, schedule)
    if isinstance(schedule, WinogradSchedule):
        from tessera.kernels.winograd import generate_winograd

        return generate_winograd(op, schedule)
    raise TypeError(f"not a schedule: {schedule!r}")


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _pointer(x, spec: Tensor, role: str, op_name: str) -> int:
    if _is_torch(x):
        import torch

        dtype_ok, contiguous, shape, device = x.dtype == torch.float32, x.is_contiguous(), tuple(x.shape), x.device.type
        if device != "cpu":
            raise ValueError(f"{op_name}: {role} {spec.name} is on {x.device}; Tessera's kernels run on the CPU")
        ptr = x.data_ptr()
    elif isinstance(x, np.ndarray):
        dtype_ok, contiguous, shape = x.dtype == np.float32, x.flags.c_contiguous, x.shape
        ptr = x.ctypes.data
    else:
        raise TypeError(f"{op_name}: {role} {spec.name} must be a numpy array or torch tensor, not {type(x).__name__}")
    if not dtype_ok:
        raise ValueError(f"{op_name}: {role} {spec.name} has dtype {x.dtype}; the kernel takes float32")
    if tuple(shape) != spec.shape:
        raise ValueError(f"{op_name}: {role} {spec.name} has shape {tuple(shape)}; the operator expects {spec.shape}")
    if not contiguous:
        raise ValueError(f"{op_name}: {role} {spec.name} is not contiguous; pass .contiguous()")
    return ptr


LINE = 64  # bytes of a cache line


def aligned_empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-order array whose data starts on a cache line, as torch allocates its
    tensors (numpy's large arrays start 16 bytes past one: every vector access to such an
    output splits across two lines; a 1x1 convolution's GEMM ran at 125 against 144-151
    GFLOP/s with its output 16 bytes off a line)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    buf = np.empty(count * dtype.itemsize + LINE, dtype=np.uint8)
    start = -buf.ctypes.data % LINE
    return buf[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


def aligned_normal(shapes, seed: int = 0) -> list[np.ndarray]:
    """Standard-normal float32 arrays of ``shapes`` (drawn in order from one generator seeded
    ``seed``), each starting on a cache line: the tuner's and the benchmark anchors' inputs."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in shapes:
        x = aligned_empty(shape)
        x[...] = rng.standard_normal(shape, dtype=np.float32)
        out.append(x)
    return out


@dataclass
class Kernel:
    op: Operator
    schedule: Schedule
    compiled: Compiled
    _fn: ctypes._CFuncPtr = field(repr=False)
    _lib: ctypes.CDLL = field(repr=False)
    parts: tuple[Kernel, ...] = ()  # kernels this one calls (a Winograd convolution's GEMM)

    @property
    def input_specs(self) -> tuple[Tensor, ...]:
        return self.op.inputs

    def __call__(self, *inputs, out=None, threads: int = 1):
        call, out = self.bind(*inputs, out=out, threads=threads)
        call()
        return out

    def bind(self, *inputs, out=None, threads: int = 1, constant: int | None = None):
        """(a call with no arguments that runs the kernel on ``inputs`` into ``out``, ``out``):
        the checks, the output's allocation and the pointer conversions done once, here, as a
        BLAS library's prepared call has them (timing loops use it: a matrix-vector product's
        whole run is a few times the cost of the checks). ``constant``: the index of an input
        whose values will not change between calls (a weight), packed once here and read packed
        by every call (GEMM schedules that pack that operand; see ``prepack_operand``)."""
        if constant is not None:
            return self._bind_prepacked(inputs, out, threads, constant)
        specs = self.op.inputs
        if len(inputs) != len(specs):
            raise ValueError(f"{self.op.name} takes {len(specs)} inputs ({', '.join(t.name for t in specs)}), got {len(inputs)}")
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        ptrs = [_pointer(x, t, "input", self.op.name) for x, t in zip(inputs, specs, strict=True)]
        spec = self.op.output.tensor
        if out is None:
            if inputs and _is_torch(inputs[0]):
                import torch

                out = torch.empty(spec.shape, dtype=torch.float32)
            else:
                out = aligned_empty(spec.shape)
        args = [ctypes.c_void_p(_pointer(out, spec, "output", self.op.name)), *[ctypes.c_void_p(p) for p in ptrs],
                ctypes.c_int(threads)]  # fmt: skip
        fn = self._fn

        def call(_alive=(out, inputs)):  # the arrays behind the pointers live as long as the call
            fn(*args)

        return call, out

    def prepack_operand(self, index: int) -> str | None:
        """"A" or "B" when input ``index`` can be packed once and read packed, else None
        ("W" for the weight, input 0, of a channel-vectorised flat convolution, transposed, or of
        a Winograd convolution, transformed; "B" of the AMX GEMM, split and laid out as tiles)."""
        if isinstance(self.schedule, DirectSchedule) and self.schedule.algo == "amx":  # a GEMM's B, not a conv's image
            return "B" if index == 1 and self.op.name.startswith("gemm") else None
        if (isinstance(self.schedule, DirectSchedule) and self.schedule.algo in ("flatc", "flatcl")) or isinstance(
                self.schedule, WinogradSchedule):
            return "W" if index == 0 else None
        if not isinstance(self.schedule, GemmSchedule) or index not in range(len(self.op.inputs)):
            return None
        con = analyse(self.op, fuse_n=self.schedule.fuse_n)
        which = {con.a.tensor.name: "A", con.b.tensor.name: "B"}.get(self.op.inputs[index].name)
        return which if which and prepackable(self.op, self.schedule, which) else None

    def _prepackable(self, index) -> str:
        """``prepack_operand(index)``, or a ValueError naming the index when there is none."""
        which = self.prepack_operand(index) if isinstance(index, int) else None
        if which is None:
            raise ValueError(f"{self.op.name}: constant={index!r} cannot be prepacked under {self.schedule.short()}; "
                             "it must name an input the GEMM schedule packs (no batch loop, no zero padding) "
                             "or the weight (0) of a flatc or Winograd convolution, or B (1) of the AMX GEMM")
        return which

    def prepack(self, index: int, value) -> Prepacked:
        """Input ``index`` (a weight: ``value``, its array) packed once, as this schedule reads it
        packed; ``run_prepacked`` then takes it in place of packing it per call."""
        which = self._prepackable(index)
        own = isinstance(self.schedule, (DirectSchedule, WinogradSchedule))  # the kernel's own entry points
        lib = self._lib if own else _prepacked_lib(self.op, self.schedule, which)
        lib.tk_prepack.restype = lib.tk_run_prepacked.restype = None
        ptr = _pointer(value, self.op.inputs[index], "input", self.op.name)
        packed = aligned_empty(ctypes.c_long.in_dll(lib, "tk_prepacked_floats").value)
        lib.tk_prepack(ctypes.c_void_p(ptr), ctypes.c_void_p(packed.ctypes.data))
        return Prepacked(index=index, data=packed, fn=lib.tk_run_prepacked, lib=lib)

    def run_prepacked(self, packed: Prepacked, *inputs, out=None, threads: int = 1):
        """The kernel on ``inputs`` with input ``packed.index`` read from ``packed`` (the array
        passed in its place is checked, not read)."""
        call, out = self._bind_prepacked(inputs, out, threads, packed)
        call()
        return out

    def _bind_prepacked(self, inputs, out, threads: int, packed):
        """``packed``: a Prepacked, or the index of the input to pack now (``bind(constant=)``)."""
        if not isinstance(packed, Prepacked):
            self._prepackable(packed)  # before the other checks, as bind(constant=) always did
        _, out = self.bind(*inputs, out=out, threads=threads)  # the checks and the output
        if not isinstance(packed, Prepacked):
            packed = self.prepack(packed, inputs[packed])
        ptrs = [_pointer(x, t, "input", self.op.name) for x, t in zip(inputs, self.op.inputs, strict=True)]
        args = [ctypes.c_void_p(_pointer(out, self.op.output.tensor, "output", self.op.name)),
                *[ctypes.c_void_p(p) for p in ptrs], ctypes.c_void_p(packed.data.ctypes.data), ctypes.c_int(threads)]
        fn = packed.fn

        def call(_alive=(out, inputs, packed)):
            fn(*args)

        return call, out

    def time(self, *inputs, threads: int = 1, repeats: int = 5, warmup: int = 1) -> list[float]:
        """Seconds per call, ``repeats`` of them (after ``warmup`` untimed calls), of the bound
        call (``bind``). The output is written once first, so no timed call (the tuner's cold
        first run included) pays for mapping its pages."""
        call, out = self.bind(*inputs, threads=threads)
        if isinstance(out, np.ndarray):
            out.fill(0.0)
        else:
            out.fill_(0.0)  # a torch tensor
        for _ in range(warmup):
            call()
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            call()
            times.append(time.perf_counter() - began)
        return times


@dataclass(frozen=True)
class Prepacked:
    """A kernel input packed once (``Kernel.prepack``): its index, the packed floats and the
    entry point that reads them."""

    index: int
    data: np.ndarray = field(repr=False)
    fn: ctypes._CFuncPtr = field(repr=False)
    lib: ctypes.CDLL = field(repr=False)


@functools.lru_cache(maxsize=64)
def _prepacked_lib(op: Operator, schedule: GemmSchedule, which: str) -> ctypes.CDLL:
    source = generate_gemm(op, schedule, prepacked=which)
    lib = load(compile_source(source, isa=schedule.isa, name=f"{op.name}_prepacked"))
    lib.tk_prepack.restype = lib.tk_run_prepacked.restype = None
    return lib


def compile_kernel(op: Operator, schedule: Schedule) -> Kernel:
    """The kernel of ``op`` under ``schedule`` (compiled once per process and cached on disk)."""
    source = generate(op, schedule)
    compiled = compile_source(source, isa=schedule.isa, name=op.name, extra_flags=extra_flags(schedule))
    if compiled.key in _LOADED:
        return _LOADED[compiled.key]
    lib = load(compiled)
    fn = lib.tk_run
    fn.restype = None
    parts = ()
    if isinstance(schedule, WinogradSchedule):  # its GEMMs run on a GEMM kernel, called through a pointer
        from tessera.kernels.winograd import gemm_op

        gemm = compile_kernel(gemm_op(op, schedule.m), schedule.gemm)
        lib.wg_set_gemm.argtypes = [ctypes.c_void_p]
        lib.wg_set_gemm(ctypes.cast(gemm._fn, ctypes.c_void_p))
        parts = (gemm,)
    kernel = Kernel(op=op, schedule=schedule, compiled=compiled, _fn=fn, _lib=lib, parts=parts)
    _LOADED[compiled.key] = kernel
    return kernel
