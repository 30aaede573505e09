"""Stencils on the operator compiler (issue 14): shapes as data (``shapes``, ``stencil``),
the ``StencilSchedule`` kind (spatial tiles, x vectorisation, decomposition into
sub-stencils, temporal blocking), its C generator, performance-model term and tuner hook,
numpy references, and acoustic wave propagation (``wave``).

The names load on first use (PEP 562), so `tessera stencil --help` imports no numpy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.runtime.lazy import lazy_names

_WHERE = {
    "StencilKernel": "tessera.stencil.kernel",
    "WaveKernel": "tessera.stencil.kernel",
    "compile_stencil": "tessera.stencil.kernel",
    "compile_wave": "tessera.stencil.kernel",
    "StencilSchedule": "tessera.stencil.schedule",
    "SHAPES": "tessera.stencil.shapes",
    "shape_weights": "tessera.stencil.shapes",
    "Point": "tessera.stencil.stencil",
    "Stencil": "tessera.stencil.stencil",
    "make_stencil": "tessera.stencil.stencil",
    "padded_shape": "tessera.stencil.stencil",
    "weight_arrays": "tessera.stencil.stencil",
}

__all__ = [
    "Point",
    "SHAPES",
    "Stencil",
    "StencilKernel",
    "StencilSchedule",
    "WaveKernel",
    "compile_stencil",
    "compile_wave",
    "make_stencil",
    "padded_shape",
    "shape_weights",
    "weight_arrays",
]


__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)


if TYPE_CHECKING:  # for type checkers and editors: the same names, eagerly
    from tessera.stencil.kernel import StencilKernel, WaveKernel, compile_stencil, compile_wave
    from tessera.stencil.schedule import StencilSchedule
    from tessera.stencil.shapes import SHAPES, shape_weights
    from tessera.stencil.stencil import Point, Stencil, make_stencil, padded_shape, weight_arrays
