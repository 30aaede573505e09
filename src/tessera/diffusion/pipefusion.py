"""PipeFusion (Fang et al. 2024): patch-level pipeline parallel inference for DiTs.

The layers are split into stages along the ``pipefusion`` mesh axis and the image's token
rows into ``num_patches`` patches. Stage s works on patch j of step t while stage s+1
works on patch j-1: every self-attention layer keeps a buffer of the K/V of the whole
sequence, in which the rows of patches already seen in step t are fresh and the rest are
one step stale (sec. 3 of the paper: successive diffusion steps have similar activations,
so stale context costs little accuracy). The last stage applies the scheduler step to its
patch and sends the new latent patch straight back to stage 0, so step t+1 starts before
step t has finished. The first ``warmup_steps`` steps run on the full sequence with fresh
K/V, synchronously; with warm-up equal to the number of steps the result is exact.

Only activations of one patch cross each stage boundary: per step, Bm*N*hidden elements
out of every stage but the last (Bm the model batch, N the tokens), and the latent back.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from tessera.diffusion.adapters import Adapter, adapter_for
from tessera.diffusion.attention import attend
from tessera.diffusion.guidance import Guidance
from tessera.diffusion.layout import ParallelConfig, split_rows, stage_bounds
from tessera.runtime.mesh import Mesh

AXIS = "pipefusion"


class StaleKVKernel:
    """Attention over a per-layer K/V buffer of the full sequence (the stale-KV buffer)."""

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}  # layer -> (2, Bm, H, N, d)
        self.seen: dict[int, int] = {}  # layer -> tokens of the buffer ever written (a prefix)
        self.start, self.stop, self.total = 0, 0, 0

    def set_span(self, start: int, stop: int, total: int) -> None:
        """The tokens [start, stop) of a sequence of ``total`` are being processed."""
        self.start, self.stop, self.total = start, stop, total

    def __call__(self, layer: int, q, k, v, text=None):
        if self.stop - self.start == self.total:  # full sequence (warm-up): all fresh
            self.buffers[layer] = torch.stack([k, v])
            self.seen[layer] = self.total
            return attend(q, k, v, text)
        buffer = self.buffers.get(layer)
        if buffer is None:
            buffer = k.new_zeros((2, *k.shape[:2], self.total, k.shape[-1]))
            self.buffers[layer] = buffer
        buffer[0, :, :, self.start : self.stop] = k
        buffer[1, :, :, self.start : self.stop] = v
        # Patches go in order, so what was ever written is a prefix; without warm-up the
        # first step attends only to the patches it has seen so far.
        self.seen[layer] = max(self.seen.get(layer, 0), self.stop)
        seen = self.seen[layer]
        return attend(q, buffer[0, :, :, :seen], buffer[1, :, :, :seen], text)


@torch.no_grad()
def pipefusion_denoise(
    adapter: Adapter,
    *,
    guidance: Guidance,
    stepper,
    noise: torch.Tensor,
    mesh: Mesh,
    config: ParallelConfig,
    progress: bool,
) -> torch.Tensor:
    """Denoise ``noise`` (B, C, H, W); every rank returns the final latent."""
    height, width = noise.shape[2:]
    p = adapter.patch_size
    rows, cols = height // p, width // p
    degree, stage = mesh.size(AXIS), mesh.rank(AXIS)
    first_layer, last_layer = stage_bounds(adapter.num_layers, degree, config.stage_layers)[stage]
    patches = split_rows(rows, config.patches)
    is_first, is_last = stage == 0, stage == degree - 1
    x = noise.clone()  # stage 0 embeds from it; the last stage steps it
    kernel = StaleKVKernel()
    comm, sends = mesh.comm, []
    steps = stepper.num_steps

    def rows_of(r0: int, r1: int) -> torch.Tensor:
        return x[:, :, r0 * p : r1 * p]

    def units_of(step: int) -> list[tuple[int, int]]:
        return [(0, rows)] if step < config.warmup_steps else patches

    with adapter.attention_kernel(kernel):
        for step in tqdm(range(steps), desc="pipefusion", disable=not progress, leave=False):
            units = units_of(step)
            if is_last and step == config.warmup_steps and 0 < step:  # warm-up -> patches
                stepper.split((0, rows), {unit: unit for unit in patches}, p, height)
            ctx = adapter.prepare(stepper.model_time(step), guidance.cond, height, width)
            for r0, r1 in units:
                if is_first:
                    if step > 0 and degree > 1:
                        _receive_latent(comm, x, units_of(step - 1), units, (r0, r1), p, degree)
                    x_in = guidance.expand(stepper.scale_input(step, rows_of(r0, r1)))
                    stream = adapter.embed(x_in, r0, height, width, ctx)
                else:
                    shapes = adapter.stream_shapes(guidance.batch, (r1 - r0) * cols, ctx)
                    stream = tuple(torch.empty(s, device=x.device, dtype=x.dtype) for s in shapes)
                    for part in stream:
                        comm.irecv(part, AXIS, src=stage - 1).wait()
                kernel.set_span(r0 * cols, r1 * cols, rows * cols)
                for layer in range(first_layer, last_layer):
                    stream = adapter.block(layer, stream, ctx, (r0 * cols, r1 * cols))
                if not is_last:
                    for part in stream:
                        part = part.contiguous()
                        sends.append((comm.isend(part, AXIS, dst=stage + 1), part))
                    continue
                out = guidance.combine(adapter.head(stream, ctx, cols))
                rows_of(r0, r1).copy_(stepper.step((r0, r1), step, rows_of(r0, r1), out))
                if degree > 1 and step < steps - 1:
                    patch = rows_of(r0, r1).contiguous()
                    sends.append((comm.isend(patch, AXIS, dst=0), patch))
            sends = _retire(sends, keep=len(units) * 4)
    for work, _ in sends:
        work.wait()
    return comm.broadcast(x.contiguous(), AXIS, src=degree - 1)


def _receive_latent(comm, x, previous_units, units, unit, p, degree) -> None:
    """Stage 0: the latent rows of ``unit`` for this step, as the last stage sent them
    after the previous step (the full latent after a warm-up step, else patch by patch)."""
    if previous_units == units:
        r0, r1 = unit
        buffer = torch.empty_like(x[:, :, r0 * p : r1 * p]).contiguous()
        comm.irecv(buffer, AXIS, src=degree - 1).wait()
        x[:, :, r0 * p : r1 * p] = buffer
    elif unit == units[0]:  # the first patch step after warm-up: one full latent arrives
        for r0, r1 in previous_units:
            buffer = torch.empty_like(x[:, :, r0 * p : r1 * p]).contiguous()
            comm.irecv(buffer, AXIS, src=degree - 1).wait()
            x[:, :, r0 * p : r1 * p] = buffer


def _retire(sends: list, keep: int) -> list:
    """Wait for all but the newest ``keep`` sends, so finished buffers can be freed."""
    for work, _ in sends[:-keep] if keep else sends:
        work.wait()
    return sends[-keep:] if keep else []


def release_other_stages(model: torch.nn.Module, config: ParallelConfig, mesh: Mesh) -> int:
    """Free the weights of the blocks this rank's stage never runs (moved to the meta
    device), which is where PipeFusion's memory saving comes from. Returns the bytes of
    the parameters still held. The model is no longer usable outside this stage."""
    adapter = adapter_for(model)
    first, last = stage_bounds(adapter.num_layers, mesh.size(AXIS), config.stage_layers)[mesh.rank(AXIS)]
    for index, block in enumerate(adapter.blocks):
        if not first <= index < last:
            block.to("meta")
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
