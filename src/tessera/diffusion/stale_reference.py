"""Plain single-process references of what the stale-K/V methods compute.

The distributed PipeFusion and DistriFusion samplers overlap communication with compute
and split the model, the batch and the sequence over ranks; what they *compute* is simple
to state, and this module states it with none of that machinery: the whole model runs on
the whole latent in one process, once per patch (or band) per step, with one attention
kernel that decides which keys and values each self-attention layer sees. Only the
patch's own rows of each pass's output are kept. Every operation of a DiT block except
self-attention is token-local, so the other tokens of a pass cannot leak into the kept
rows: their hidden states are never used, because the keys and values they would offer
are replaced by the buffers below.

PipeFusion (Fang et al. 2024, sec. 3.2 and Fig. 3), after the warm-up steps: step t takes
the patches in order, and patch j goes through every layer; each self-attention layer
keeps one K/V buffer of the whole sequence, patch j writes its fresh K/V into its span
and attends over the buffer, in which patches 0..j hold step t's K/V and patches j+1..
step t-1's. The scheduler step is applied to patch j's rows as soon as it leaves the last
layer. Without warm-up there is no step t-1 in the first step: patch j attends to the
patches written so far (0..j), which is what Tessera's pipeline does.

DistriFusion (Li et al. 2024, sec. 4.1): band i attends with its own fresh K/V and every
other band's K/V from the previous step; without warm-up, the first step attends to its
own band only.

Warm-up steps run the whole sequence with fresh K/V (exact), filling the buffers.
These references are P times slower than serial sampling and are meant for tests and for
measuring the distributed runs against their own semantics.
"""

from __future__ import annotations

import torch

from tessera.diffusion.adapters import adapter_for
from tessera.diffusion.attention import attend
from tessera.diffusion.guidance import Cond
from tessera.diffusion.layout import ParallelConfig, split_rows
from tessera.diffusion.sampler import initial_noise
from tessera.diffusion.stepper import FlowStepper


class PipeFusionKV:
    """Which K/V each layer sees under PipeFusion. ``part`` is the patch being computed
    (None in a warm-up step: every token fresh)."""

    def __init__(self, spans: list[tuple[int, int]]):
        self.spans = spans
        self.part: int | None = None
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (K, V)
        self.written: dict[int, int] = {}  # layer -> tokens ever written (a prefix)

    def __call__(self, layer: int, q, k, v, text=None):
        if self.part is None:
            self.buffers[layer] = (k.clone(), v.clone())
            self.written[layer] = k.shape[2]
            return attend(q, k, v, text)
        a, b = self.spans[self.part]
        if layer not in self.buffers:
            self.buffers[layer] = (torch.zeros_like(k), torch.zeros_like(v))
        keys, values = self.buffers[layer]
        keys[:, :, a:b], values[:, :, a:b] = k[:, :, a:b], v[:, :, a:b]
        seen = self.written[layer] = max(self.written.get(layer, 0), b)
        return attend(q, keys[:, :, :seen], values[:, :, :seen], text)

    def end_step(self) -> None:
        pass


class DistriFusionKV:
    """Which K/V each layer sees under DistriFusion. ``part`` is the band being computed
    (None in a warm-up step)."""

    def __init__(self, spans: list[tuple[int, int]]):
        self.spans = spans
        self.part: int | None = None
        self.stale: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the previous step's
        self.fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this step's, band by band

    def __call__(self, layer: int, q, k, v, text=None):
        if self.part is None:
            self.stale[layer] = (k.clone(), v.clone())
            return attend(q, k, v, text)
        a, b = self.spans[self.part]
        fresh = self.fresh.setdefault(layer, (torch.zeros_like(k), torch.zeros_like(v)))
        fresh[0][:, :, a:b], fresh[1][:, :, a:b] = k[:, :, a:b], v[:, :, a:b]
        if layer not in self.stale:
            return attend(q, k[:, :, a:b], v[:, :, a:b], text)
        keys, values = (t.clone() for t in self.stale[layer])
        keys[:, :, a:b], values[:, :, a:b] = k[:, :, a:b], v[:, :, a:b]
        return attend(q, keys, values, text)

    def end_step(self) -> None:
        if self.fresh:
            self.stale, self.fresh = self.fresh, {}


@torch.no_grad()
def stale_reference_denoise(
    model: torch.nn.Module,
    *,
    config: ParallelConfig,
    cond: Cond,
    uncond: Cond | None,
    guidance_scale: float,
    stepper,
    noise: torch.Tensor,
) -> torch.Tensor:
    """The latent PipeFusion or DistriFusion (as ``config`` says, with its patches or
    bands and warm-up steps) should return, computed plainly in this process."""
    if config.method not in ("pipefusion", "distrifusion"):
        raise ValueError(f"stale_reference_denoise is for pipefusion or distrifusion, not {config.method!r}")
    adapter = adapter_for(model)
    for branch in (cond, uncond) if uncond is not None else (cond,):
        adapter.check_cond(branch)
    height, width = noise.shape[2:]
    p = adapter.patch_size
    rows, cols = height // p, width // p
    parts = split_rows(rows, config.patches if config.method == "pipefusion" else config.distrifusion)
    spans = [(r0 * cols, r1 * cols) for r0, r1 in parts]
    kv = (PipeFusionKV if config.method == "pipefusion" else DistriFusionKV)(spans)
    guided = guidance_scale != 1.0
    both = {key: torch.cat([cond[key], uncond[key]]) for key in cond} if guided else cond
    x = noise.clone()

    def velocity(step: int, ctx) -> torch.Tensor:
        x_in = stepper.scale_input(step, x)
        stream = adapter.embed(torch.cat([x_in, x_in]) if guided else x_in, 0, height, width, ctx)
        for layer in range(adapter.num_layers):
            stream = adapter.block(layer, stream, ctx, [(0, rows * cols)])
        out = adapter.head(stream, ctx, cols)
        if guided:
            c, u = out.chunk(2)
            out = u + guidance_scale * (c - u)
        return out

    with adapter.attention_kernel(kv):
        for step in range(stepper.num_steps):
            ctx = adapter.prepare(stepper.model_time(step), both, height, width)
            if step < config.warmup_steps:
                kv.part = None
                out = velocity(step, ctx)
            for j, (r0, r1) in enumerate(parts):
                if step >= config.warmup_steps:
                    kv.part = j
                    out = velocity(step, ctx)
                band = slice(r0 * p, r1 * p)
                x[:, :, band] = stepper.step(j, step, x[:, :, band].clone(), out[:, :, band])
            kv.end_step()
    return x


def stale_reference_sample(
    model: torch.nn.Module,
    labels: torch.Tensor,
    *,
    config: ParallelConfig,
    height: int,
    width: int,
    num_steps: int,
    guidance_scale: float = 1.0,
    seed: int = 0,
) -> torch.Tensor:
    """:func:`stale_reference_denoise` for Tessera's DiT, from the noise
    :func:`tessera.diffusion.parallel.parallel_sample` starts from."""
    param = next(model.parameters())
    labels = labels.to(param.device)
    shape = (labels.shape[0], model.config.in_channels, height, width)
    noise = initial_noise(shape, seed, param.device, param.dtype)
    return stale_reference_denoise(
        model,
        config=config,
        cond={"labels": labels},
        uncond={"labels": torch.full_like(labels, model.null_class)},
        guidance_scale=guidance_scale,
        stepper=FlowStepper(num_steps),
        noise=noise,
    )
