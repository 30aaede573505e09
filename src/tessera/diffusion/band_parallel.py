"""Samplers where each rank owns one horizontal band of the image through every layer:
sequence parallel (Ulysses x Ring, "USP") and DistriFusion (Li et al. 2024, patch
parallel with one-step-stale K/V all-gathered asynchronously).

Both run the whole model on the band's tokens; they differ only in the attention kernel.
At the end the bands are all-gathered so every rank holds the full latent.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from tessera.diffusion.adapters import Adapter
from tessera.diffusion.attention import attend, ulysses_attention
from tessera.diffusion.guidance import Guidance
from tessera.runtime.mesh import Mesh


class USPKernel:
    """Ulysses over ``ulysses``, then Ring over ``ring`` inside each Ulysses group."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def begin_step(self, step_index: int) -> None:
        pass

    def end_step(self) -> None:
        pass

    def __call__(self, layer: int, q, k, v, text=None):
        return ulysses_attention(q, k, v, self.mesh.comm, "ulysses", ring_axis="ring", text=text)


class DistriFusionKernel:
    """Fresh K/V for my band, last step's K/V for the other bands (Li et al. 2024, sec. 4.1).

    Each layer all-gathers its fresh K/V asynchronously; the result is only used in the
    next step, so the communication hides behind the rest of this step. The first
    ``warmup_steps`` gather synchronously and use fresh K/V everywhere: with warm-up equal
    to the number of steps the method is exact. With no warm-up, the first step attends
    to its own band only.
    """

    def __init__(self, mesh: Mesh, warmup_steps: int, axis: str = "distrifusion"):
        self.mesh, self.warmup_steps, self.axis = mesh, warmup_steps, axis
        self.stale: dict[int, torch.Tensor] = {}  # layer -> stacked (K, V) of the full sequence
        self.pending: dict[int, Callable[[], torch.Tensor]] = {}
        self.sync = True

    def begin_step(self, step_index: int) -> None:
        self.sync = step_index < self.warmup_steps

    def end_step(self) -> None:
        for layer, finish in self.pending.items():
            self.stale[layer] = finish()
        self.pending.clear()

    def __call__(self, layer: int, q, k, v, text=None):
        fresh = torch.stack([k, v]).contiguous()  # (2, B, H, n_band, d): one gather for both
        if self.sync:
            full = self.mesh.comm.all_gather(fresh, self.axis, dim=3)
            self.stale[layer] = full
        else:
            self.pending[layer] = self.mesh.comm.all_gather_async(fresh, self.axis, dim=3)
            if layer not in self.stale:  # no warm-up: nothing seen of the other bands yet
                return attend(q, k, v, text)
            n = k.shape[2]
            start = self.mesh.rank(self.axis) * n
            # In place: this step's gather replaces the whole buffer at end_step anyway.
            full = self.stale[layer]
            full[:, :, :, start : start + n] = fresh
        return attend(q, full[0], full[1], text)


def band_index(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """Position of this rank's band: row-major over ``axes`` (outer first)."""
    index = 0
    for axis in axes:
        index = index * mesh.size(axis) + mesh.rank(axis)
    return index


@torch.no_grad()
def band_denoise(
    adapter: Adapter,
    *,
    guidance: Guidance,
    stepper,
    noise: torch.Tensor,
    mesh: Mesh,
    band_axes: tuple[str, ...],
    kernel,
    progress: bool,
) -> torch.Tensor:
    """Denoise ``noise`` (B, C, H, W); every rank returns the final latent."""
    height, width = noise.shape[2:]
    p = adapter.patch_size
    rows, cols = height // p, width // p
    bands = math.prod(mesh.size(a) for a in band_axes)
    if rows % bands:
        raise ValueError(
            f"{rows} token rows (height {height} / patch {p}) do not split evenly over "
            f"{bands} ranks of {'x'.join(band_axes)}; choose a height that is a multiple of {bands * p}"
        )
    band_rows = rows // bands
    first_row = band_index(mesh, band_axes) * band_rows
    x = noise[:, :, first_row * p : (first_row + band_rows) * p].contiguous()
    span = (first_row * cols, (first_row + band_rows) * cols)  # this band's image tokens
    with adapter.attention_kernel(kernel) if kernel else contextlib.nullcontext():
        for step in tqdm(range(stepper.num_steps), desc="sampling", disable=not progress, leave=False):
            if kernel:
                kernel.begin_step(step)
            ctx = adapter.prepare(stepper.model_time(step), guidance.cond, height, width)
            stream = adapter.embed(
                guidance.expand(stepper.scale_input(step, x)), first_row, height, width, ctx
            )
            for layer in range(adapter.num_layers):
                stream = adapter.block(layer, stream, ctx, [span])
            out = guidance.combine(adapter.head(stream, ctx, cols))
            x = stepper.step("band", step, x, out)
            if kernel:
                kernel.end_step()
    for axis in reversed(band_axes):  # innermost first: neighbouring bands join first
        x = mesh.comm.all_gather(x, axis, dim=2)
    return x
