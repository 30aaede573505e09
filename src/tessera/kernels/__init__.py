"""Tessera's operator compiler (swATOP / swDNN on this CPU): operators as loop nests over
named axes (``ir``, ``ops``), tensorized primitives in C (``csrc``), schedules as data
(``schedule``, ``space``), two code generators (``codegen_gemm``, ``codegen_loops``), the
system C compiler with an on-disk cache (``compiler``), a measured machine (``machine``),
an analytic performance model (``model``), a model-guided tuner (``tuner``) and torch
custom ops and modules (``torch_ops``, ``nn``; imported on first use)."""

from tessera.kernels.compiler import CompilerError
from tessera.kernels.contraction import NotTensorizable
from tessera.kernels.ir import Access, Affine, Axis, Operator, Tensor
from tessera.kernels.kernel import Kernel, compile_kernel
from tessera.kernels.machine import Machine, load_machine
from tessera.kernels.model import predict
from tessera.kernels.ops import Conv2dShape, batched_gemm, col2im, conv2d, gemm
from tessera.kernels.schedule import GemmSchedule, LoopSchedule
from tessera.kernels.tuner import best_schedule, tune

_TORCH_NAMES = {"Linear": "nn", "Conv2d": "nn", "convert": "nn", "set_tuning": "torch_ops"}


def __getattr__(name: str):
    if name in _TORCH_NAMES:  # torch is imported only when the torch side is used
        import importlib

        return getattr(importlib.import_module(f"tessera.kernels.{_TORCH_NAMES[name]}"), name)
    raise AttributeError(f"module 'tessera.kernels' has no attribute {name!r}")


__all__ = [
    "Access", "Affine", "Axis", "CompilerError", "Conv2d", "Conv2dShape", "GemmSchedule", "Kernel", "Linear",
    "LoopSchedule", "Machine", "NotTensorizable", "Operator", "Tensor", "batched_gemm", "best_schedule", "col2im",
    "compile_kernel", "conv2d", "convert", "gemm", "load_machine", "predict", "set_tuning", "tune",
]
