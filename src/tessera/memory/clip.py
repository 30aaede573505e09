"""Gradient clipping's one rule, shared by every training path (the ZeRO core, its offloaded
step chunk by chunk, and the pipelined optimizer): each computes the global norm its own way
(over its shards, chunks or stages) and scales by the same factor, torch's
``clip_grad_norm_``'s ``max_norm / (norm + 1e-6)`` when it is below 1."""

from __future__ import annotations


def clip_coefficient(norm: float, max_norm: float) -> float | None:
    """The factor to multiply every gradient by, or None where the norm is within ``max_norm``."""
    scale = max_norm / (norm + 1e-6)
    return scale if scale < 1 else None
