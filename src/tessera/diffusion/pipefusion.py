"""PipeFusion (Fang et al. 2024): patch-level pipeline parallel inference for DiTs.

The layers are split into stages along the ``pipefusion`` mesh axis and the image's token
rows into ``num_patches`` patches. Stage s works on patch j of step t while stage s+1
works on patch j-1: every self-attention layer keeps a buffer of the K/V of the whole
sequence, in which the patches already seen in step t are fresh and the rest are one step
stale (sec. 3 of the paper: successive diffusion steps have similar activations, so stale
context costs little accuracy). The last stage applies the scheduler step to its patch and
sends the new latent patch straight back to stage 0, so step t+1 starts before step t has
finished. The first ``warmup_steps`` steps run all patches at once with fresh K/V,
synchronously; with warm-up equal to the number of steps the result is exact.

Inside each stage, a sequence-parallel group (``ring`` x ``ulysses``) can share every
patch: rank k of the group owns the k-th sub-band of rows of each patch, attention runs
Ulysses then Ring over the group (USP), and each rank's stale-K/V buffer holds its heads
for its ring chunk of every patch. Without such a group a rank owns whole patches.

Only activations of one patch cross a stage boundary: per step, Bm*N*hidden elements out
of every stage but the last (Bm the model batch, N the tokens), and the latent back.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from tessera.diffusion.adapters import Adapter, adapter_for
from tessera.diffusion.attention import ring_attention
from tessera.diffusion.guidance import Guidance
from tessera.diffusion.layout import ParallelConfig, split_rows, stage_bounds
from tessera.runtime.mesh import Mesh

AXIS = "pipefusion"


class StaleKVKernel:
    """Attention of a unit of patches over the stale-KV buffer, with Ulysses/Ring inside
    the stage's sequence-parallel group (sizes 1 make those steps no-ops)."""

    def __init__(self, mesh: Mesh, patch_tokens: list[int], model_batch: int):
        self.comm, self.model_batch = mesh.comm, model_batch
        self.ulysses, self.ring = mesh.size("ulysses"), mesh.size("ring")
        sp = self.ulysses * self.ring
        self.local = [n // sp for n in patch_tokens]  # this rank's tokens of each patch
        slots = [n // self.ring for n in patch_tokens]  # buffer tokens of each patch (a ring chunk)
        self.offsets = [sum(slots[:j]) for j in range(len(slots) + 1)]
        self.buffers: dict[int, torch.Tensor] = {}  # layer -> (2, Bm, H/ulysses, tokens/ring, d)
        self.seen: dict[int, int] = {}  # layer -> buffer tokens ever written (a prefix)
        self.unit: list[int] = []
        self.rows = slice(0, model_batch)

    def set_unit(self, patches: list[int], batch: tuple[int, int]) -> None:
        """The (consecutive) patches, and the rows of the model batch, processed next."""
        self.unit, self.rows = patches, slice(*batch)

    def _to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, local tokens of the unit) -> (B, H/U, ring chunks of the unit), patch-major."""
        if self.ulysses == 1:
            return t
        parts = t.split([self.local[j] for j in self.unit], dim=2)
        return torch.cat(
            [self.comm.all_to_all(p.contiguous(), "ulysses", scatter_dim=1, gather_dim=2) for p in parts],
            dim=2,
        )

    def _to_tokens(self, t: torch.Tensor) -> torch.Tensor:
        if self.ulysses == 1:
            return t
        parts = t.split([self.local[j] * self.ulysses for j in self.unit], dim=2)
        return torch.cat(
            [self.comm.all_to_all(p.contiguous(), "ulysses", scatter_dim=2, gather_dim=1) for p in parts],
            dim=2,
        )

    def __call__(self, layer: int, q, k, v, text=None):
        q, k, v = (self._to_heads(t) for t in (q, k, v))
        if text is not None:  # replicated text tokens take this rank's heads (see ulysses_attention)
            text = tuple(t.chunk(self.ulysses, dim=1)[self.comm.mesh.rank("ulysses")] for t in text)
        buffer = self.buffers.get(layer)
        if buffer is None:
            buffer = k.new_zeros((2, self.model_batch, k.shape[1], self.offsets[-1], k.shape[-1]))
            self.buffers[layer] = buffer
        start, stop = self.offsets[self.unit[0]], self.offsets[self.unit[-1] + 1]
        mine = buffer[:, self.rows]
        mine[0, :, :, start:stop] = k
        mine[1, :, :, start:stop] = v
        # Patches go in order, so what was ever written is a prefix; without warm-up the
        # first step attends only to the patches it has seen so far.
        seen = self.seen[layer] = max(self.seen.get(layer, 0), stop)
        out = ring_attention(q, mine[0, :, :, :seen], mine[1, :, :, :seen], self.comm, "ring", text)
        if text is None:
            return self._to_tokens(out)
        image, text_out = out
        return self._to_tokens(image), self.comm.all_gather(text_out.contiguous(), "ulysses", dim=1)


def sub_bands(rows: int, num_patches: int, sp: int, index: int) -> list[tuple[int, int]]:
    """This rank's rows [start, stop) of each patch: sub-band ``index`` of ``sp``."""
    bands = []
    for r0, r1 in split_rows(rows, num_patches):
        if (r1 - r0) % sp:
            raise ValueError(
                f"a patch of {r1 - r0} token rows does not split over the {sp} ranks of ulysses x ring; "
                f"use patches whose row counts are multiples of {sp} (rows {rows}, patches {num_patches})"
            )
        size = (r1 - r0) // sp
        bands.append((r0 + index * size, r0 + (index + 1) * size))
    return bands


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
    sp = mesh.size("ring") * mesh.size("ulysses")
    mine = sub_bands(
        rows, config.patches, sp, mesh.rank("ring") * mesh.size("ulysses") + mesh.rank("ulysses")
    )
    kernel = StaleKVKernel(
        mesh, [(r1 - r0) * cols for r0, r1 in split_rows(rows, config.patches)], guidance.batch
    )
    is_first, is_last = stage == 0, stage == degree - 1
    x = noise.clone()  # stage 0 embeds from its rows; the last stage steps them
    comm, sends, steps = mesh.comm, [], stepper.num_steps
    everything, whole = list(range(config.patches)), (0, guidance.batch)
    # Warm-up steps cannot be pipelined by patches (every patch needs every other's fresh
    # K/V), but they can by micro-batches of the model batch (e.g. the two CFG branches):
    # batch rows are independent, so this is exact and hides part of the warm-up bubble.
    micro = split_rows(guidance.batch, min(degree, guidance.batch))

    def latent_rows(j: int) -> torch.Tensor:
        return x[:, :, mine[j][0] * p : mine[j][1] * p]

    with adapter.attention_kernel(kernel):
        for step in tqdm(range(steps), desc="pipefusion", disable=not progress, leave=False):
            warm = step < config.warmup_steps
            units = [(everything, mb) for mb in micro] if warm else [([j], whole) for j in everything]
            ctxs = {
                mb: adapter.prepare(stepper.model_time(step), _rows(guidance.cond, mb), height, width)
                for mb in {mb for _, mb in units}
            }
            outputs = []
            for unit, mb in units:
                ctx = ctxs[mb]
                spans = [(mine[j][0] * cols, mine[j][1] * cols) for j in unit]
                if is_first:
                    if step > 0 and degree > 1 and mb[0] == 0:  # each step's latent arrives once
                        for j in unit:  # as the last stage sent it after the previous step
                            _receive_into(comm, latent_rows(j), src=degree - 1)
                    bands = [
                        guidance.expand(stepper.scale_input(step, latent_rows(j)))[mb[0] : mb[1]]
                        for j in unit
                    ]
                    stream = _embed(adapter, bands, [mine[j][0] for j in unit], height, width, ctx)
                else:
                    tokens = sum(b - a for a, b in spans)
                    shapes = adapter.stream_shapes(mb[1] - mb[0], tokens, ctx)
                    stream = tuple(torch.empty(s, device=x.device, dtype=x.dtype) for s in shapes)
                    for part in stream:
                        comm.irecv(part, AXIS, src=stage - 1).wait()
                kernel.set_unit(unit, mb)
                for layer in range(first_layer, last_layer):
                    stream = adapter.block(layer, stream, ctx, spans)
                if not is_last:
                    for part in stream:
                        part = part.contiguous()
                        sends.append((comm.isend(part, AXIS, dst=stage + 1), part))
                    continue
                outputs.append(adapter.head(stream, ctx, cols))
                if mb[1] < guidance.batch:  # wait for the unit's other micro-batches
                    continue
                out = guidance.combine(torch.cat(outputs))
                outputs = []
                row_counts = [(mine[j][1] - mine[j][0]) * p for j in unit]
                for j, out_j in zip(unit, out.split(row_counts, dim=2), strict=True):
                    latent_rows(j).copy_(stepper.step(j, step, latent_rows(j), out_j))
                    if degree > 1 and step < steps - 1:
                        patch = latent_rows(j).contiguous()
                        sends.append((comm.isend(patch, AXIS, dst=0), patch))
            sends = _retire(sends, keep=4 * config.patches)
    for work, _ in sends:
        work.wait()
    return comm.broadcast(_assemble(x, mesh, config, rows, p), AXIS, src=degree - 1)


def _rows(cond: dict[str, torch.Tensor], batch: tuple[int, int]) -> dict[str, torch.Tensor]:
    return {k: v[batch[0] : batch[1]] for k, v in cond.items()}


def _receive_into(comm, rows: torch.Tensor, *, src: int) -> None:
    buffer = torch.empty_like(rows).contiguous()
    comm.irecv(buffer, AXIS, src=src).wait()
    rows.copy_(buffer)


def _embed(adapter: Adapter, bands: list[torch.Tensor], row_offsets: list[int], height: int, width: int, ctx):
    """One stream from several bands of latent rows (their image tokens concatenated)."""
    parts = [
        adapter.embed(band, offset, height, width, ctx)
        for band, offset in zip(bands, row_offsets, strict=True)
    ]
    image = torch.cat([part[0] for part in parts], dim=1)
    return (image, *parts[0][1:])  # joint-attention models: the text stream is shared


def _assemble(x: torch.Tensor, mesh: Mesh, config: ParallelConfig, rows: int, p: int) -> torch.Tensor:
    """The full latent from every sequence-parallel rank's sub-bands of each patch."""
    if mesh.size("ring") * mesh.size("ulysses") == 1:
        return x.contiguous()
    sp = mesh.size("ring") * mesh.size("ulysses")
    index = mesh.rank("ring") * mesh.size("ulysses") + mesh.rank("ulysses")
    patches = []
    for (r0, r1), (s0, s1) in zip(
        split_rows(rows, config.patches), sub_bands(rows, config.patches, sp, index), strict=True
    ):
        part = x[:, :, s0 * p : s1 * p].contiguous()
        for axis in ("ulysses", "ring"):  # innermost first: neighbouring sub-bands join first
            part = mesh.comm.all_gather(part, axis, dim=2)
        assert part.shape[2] == (r1 - r0) * p
        patches.append(part)
    return torch.cat(patches, dim=2).contiguous()


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
