"""Stencils on the operator compiler (issue 14): shapes as data (``shapes``, ``stencil``),
the ``StencilSchedule`` kind (spatial tiles, x vectorisation, decomposition into
sub-stencils, temporal blocking), its C generator, performance-model term and tuner hook,
numpy references, and acoustic wave propagation (``wave``)."""

from tessera.stencil.kernel import StencilKernel, WaveKernel, compile_stencil, compile_wave
from tessera.stencil.schedule import StencilSchedule
from tessera.stencil.shapes import SHAPES, shape_weights
from tessera.stencil.stencil import Point, Stencil, make_stencil, padded_shape, weight_arrays

__all__ = [
    "SHAPES", "Point", "Stencil", "StencilKernel", "StencilSchedule", "WaveKernel", "compile_stencil", "compile_wave",
    "make_stencil", "padded_shape", "shape_weights", "weight_arrays",
]
