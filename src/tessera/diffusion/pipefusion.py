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

from tessera.diffusion.adapter import DiTAdapter
from tessera.diffusion.attention import attention
from tessera.diffusion.guidance import Guidance
from tessera.diffusion.layout import ParallelConfig, split_rows, stage_bounds
from tessera.diffusion.sampler import FlowMatchEuler, initial_noise
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

    def __call__(self, layer: int, q, k, v):
        fresh = torch.stack([k, v])
        if self.stop - self.start == self.total:  # full sequence (warm-up): all fresh
            self.buffers[layer] = fresh
            self.seen[layer] = self.total
            return attention(q, k, v)
        buffer = self.buffers.get(layer)
        if buffer is None:
            buffer = fresh.new_zeros((*fresh.shape[:3], self.total, fresh.shape[-1]))
            self.buffers[layer] = buffer
        buffer[:, :, :, self.start : self.stop] = fresh
        # Patches go in order, so what was ever written is a prefix; without warm-up the
        # first step attends only to the patches it has seen so far.
        self.seen[layer] = max(self.seen.get(layer, 0), self.stop)
        seen = self.seen[layer]
        return attention(q, buffer[0, :, :, :seen], buffer[1, :, :, :seen])


@torch.no_grad()
def pipefusion_sample(
    adapter: DiTAdapter,
    labels: torch.Tensor,
    *,
    mesh: Mesh,
    config: ParallelConfig,
    height: int,
    width: int,
    num_steps: int,
    guidance_scale: float,
    seed: int,
    progress: bool,
) -> torch.Tensor:
    """The final latent (B, C, H, W), on every rank."""
    p = adapter.patch_size
    rows, cols = height // p, width // p
    degree, stage = mesh.size(AXIS), mesh.rank(AXIS)
    first_layer, last_layer = stage_bounds(adapter.num_layers, degree, config.stage_layers)[stage]
    patches = split_rows(rows, config.patches)
    is_first, is_last = stage == 0, stage == degree - 1
    param = next(adapter.model.parameters())
    device = param.device
    guidance = Guidance(labels.to(device), adapter.null_class, guidance_scale, mesh)
    x = initial_noise((labels.shape[0], adapter.in_channels, height, width), seed, device, param.dtype)
    scheduler = FlowMatchEuler()
    times = scheduler.timesteps(num_steps).tolist()
    kernel = StaleKVKernel()
    comm, sends = mesh.comm, []
    model_batch = guidance.labels.shape[0]

    def rows_of(x_: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        return x_[:, :, r0 * p : r1 * p]

    with adapter.attention_kernel(kernel):
        for step in tqdm(range(num_steps), desc="pipefusion", disable=not progress, leave=False):
            t, t_next = times[step], times[step + 1]
            units = [(0, rows)] if step < config.warmup_steps else patches
            previous_units = [(0, rows)] if step - 1 < config.warmup_steps else patches
            c = adapter.condition(torch.full((model_batch,), t, device=device), guidance.labels)
            for r0, r1 in units:
                if is_first:
                    if step > 0 and degree > 1:
                        _receive_latent(comm, x, previous_units, units, (r0, r1), p, degree)
                    h = adapter.embed(guidance.expand(rows_of(x, r0, r1)), r0)
                else:
                    h = torch.empty(
                        (model_batch, (r1 - r0) * cols, adapter.hidden_size), device=device, dtype=param.dtype
                    )
                    comm.irecv(h, AXIS, src=stage - 1).wait()
                kernel.set_span(r0 * cols, r1 * cols, rows * cols)
                for layer in range(first_layer, last_layer):
                    h = adapter.block(layer, h, c)
                if not is_last:
                    h = h.contiguous()
                    sends.append((comm.isend(h, AXIS, dst=stage + 1), h))
                    continue
                v = guidance.combine(adapter.head(h, c, cols))
                rows_of(x, r0, r1).copy_(scheduler.step(rows_of(x, r0, r1), v, t, t_next))
                if degree > 1 and step < num_steps - 1:
                    patch = rows_of(x, r0, r1).contiguous()
                    sends.append((comm.isend(patch, AXIS, dst=0), patch))
            sends = _retire(sends, keep=len(units))
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
    adapter = DiTAdapter(model)
    first, last = stage_bounds(adapter.num_layers, mesh.size(AXIS), config.stage_layers)[mesh.rank(AXIS)]
    for index, block in enumerate(adapter.blocks):
        if not first <= index < last:
            block.to("meta")
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
