"""Helpers shared by the parity tests."""

import torch


def perturbed(module: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    """Random weights moved off a zero-initialised start (adaLN-zero makes every block the
    identity there, and any two methods would agree trivially)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)
    return module.eval()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: random models' latents reach ~1e3 with cancellations, where
    per-element relative checks are ill-conditioned."""
    return ((a - b).norm() / b.norm()).item()
