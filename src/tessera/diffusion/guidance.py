"""Classifier-free guidance for the parallel samplers, with the branches optionally on
two ranks (CFG parallel: the ``cfg`` mesh axis).

A conditioning is a dict of batch-first tensors (class labels for Tessera's DiT; text
embeddings, masks and pooled vectors for diffusers models), so branches can be stacked.
"""

from __future__ import annotations

import torch

from tessera.runtime.mesh import Mesh

Cond = dict[str, torch.Tensor]


def cat_cond(a: Cond, b: Cond) -> Cond:
    return {k: torch.cat([a[k], b[k]]) for k in a}


class Guidance:
    """Which conditioning this rank runs, and how its outputs become the guided one."""

    def __init__(self, cond: Cond, uncond: Cond | None, scale: float, mesh: Mesh):
        self.scale, self.mesh = scale, mesh
        self.active = scale != 1.0
        self.split = mesh.size("cfg") == 2
        if self.split and not self.active:
            raise ValueError("cfg parallel needs classifier-free guidance: guidance_scale is 1.0")
        if self.active and uncond is None:
            raise ValueError(f"guidance_scale {scale} needs an unconditional branch (a negative prompt)")
        if self.split:
            self.cond = cond if mesh.rank("cfg") == 0 else uncond
        elif self.active:
            self.cond = cat_cond(cond, uncond)
        else:
            self.cond = cond
        self.batch = next(iter(self.cond.values())).shape[0]

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """The model input batch for latents ``x`` (doubled when both branches run here)."""
        return torch.cat([x, x]) if self.active and not self.split else x

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return out
        both = self.mesh.comm.all_gather(out, "cfg", dim=0) if self.split else out
        cond, uncond = both.chunk(2)
        return uncond + self.scale * (cond - uncond)
