"""Classifier-free guidance for the parallel samplers, with the branches optionally on
two ranks (CFG parallel: the ``cfg`` mesh axis)."""

from __future__ import annotations

import torch

from tessera.runtime.mesh import Mesh


class Guidance:
    """Which labels this rank runs, and how its velocities become the guided one."""

    def __init__(self, labels: torch.Tensor, null_class: int, scale: float, mesh: Mesh):
        self.scale, self.mesh = scale, mesh
        self.active = scale != 1.0
        self.split = mesh.size("cfg") == 2
        if self.split and not self.active:
            raise ValueError("cfg parallel needs classifier-free guidance: guidance_scale is 1.0")
        null = torch.full_like(labels, null_class)
        if self.split:
            self.labels = labels if mesh.rank("cfg") == 0 else null
        elif self.active:
            self.labels = torch.cat([labels, null])
        else:
            self.labels = labels

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """The model input batch for latents ``x`` (doubled when both branches run here)."""
        return torch.cat([x, x]) if self.active and not self.split else x

    def combine(self, v: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return v
        both = self.mesh.comm.all_gather(v, "cfg", dim=0) if self.split else v
        cond, uncond = both.chunk(2)
        return uncond + self.scale * (cond - uncond)
