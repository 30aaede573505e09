"""What one rank of a generation server's group does: load the model once, then run the
batches rank 0 broadcasts, for as long as the server lives.

A batch is a list of parts that share the image size, the step count and the guidance
scale; each part is one request's images (its own labels or prompt, its own seed). The
batch runs through ``parallel_denoise`` under the server's ``ParallelConfig`` as
``tessera generate`` runs one image: the same initial noise per part (drawn from the part's
seed exactly as ``tessera generate`` draws it), the same conditions, the same stepper.
Rank 0 decodes and answers PNGs.

Cancellation is agreed through shared memory rather than a collective: each rank, at the
start of every step, records the step under a lock and stops if the server asked the batch
to stop at that step. The server picks the stop step one past the furthest step any rank
has begun, so every rank stops at the same step boundary, where no collective is half done.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)
NO_STOP = 1 << 30


class Cancelled(Exception):
    """The server stopped this batch (cancelled by its callers, or timed out)."""


@dataclass(frozen=True, kw_only=True)
class Part:
    """One request's share of a batch: class labels (a Tessera DiT checkpoint) or a prompt
    and an image count (a diffusers pipeline), and the seed of its first image."""

    request_id: int
    seed: int
    labels: tuple[int, ...] = ()
    prompt: str = ""
    negative_prompt: str = ""
    count: int = 1

    @property
    def images(self) -> int:
        return len(self.labels) if self.labels else self.count


@dataclass(frozen=True, kw_only=True)
class Batch:
    id: int
    height: int
    width: int
    steps: int
    guidance: float
    parts: tuple[Part, ...]
    frames: int = 0  # a video pipeline's frame count (0: an image model)
    fail_on_rank: int | None = None  # tests: this rank raises instead of running (a fault drill)

    @property
    def images(self) -> int:
        return sum(p.images for p in self.parts)


@dataclass
class Shared:
    """Shared-memory cells between the server and its ranks (multiprocessing values)."""

    lock: Any
    batch: Any  # the batch each rank is in (Array of int)
    step: Any  # the step each rank has begun (Array of int)
    stop_batch: Any  # Value: the batch asked to stop
    stop_step: Any  # Value: the step it stops at

    @classmethod
    def create(cls, ctx, world_size: int) -> Shared:
        lock = ctx.Lock()
        return cls(
            lock=lock,
            batch=ctx.Array("q", [-1] * world_size, lock=False),
            step=ctx.Array("q", [-1] * world_size, lock=False),
            stop_batch=ctx.Value("q", -1, lock=False),
            stop_step=ctx.Value("q", NO_STOP, lock=False),
        )

    def request_stop(self, batch_id: int) -> int:
        """Ask ``batch_id`` to stop one step past the furthest any rank has begun; that step."""
        with self.lock:
            begun = [s for b, s in zip(self.batch, self.step, strict=True) if b == batch_id]
            stop = max(begun, default=-1) + 1
            self.stop_batch.value, self.stop_step.value = batch_id, stop
            return stop

    def progress(self, batch_id: int) -> int:
        """The furthest step of ``batch_id`` any rank has begun (-1: none yet)."""
        with self.lock:
            return max((s for b, s in zip(self.batch, self.step, strict=True) if b == batch_id), default=-1)


class StepHook:
    """Wraps a stepper: the first call for each step records it and may stop the batch there
    (every rank calls ``model_time`` at the start of each step, before that step's
    communication); step times are kept for the server's step-latency histogram."""

    def __init__(self, stepper, shared: Shared, rank: int, batch_id: int):
        self.inner, self.shared, self.rank, self.batch_id = stepper, shared, rank, batch_id
        self.num_steps = stepper.num_steps
        self.current, self.started = -1, time.perf_counter()
        self.step_seconds: list[float] = []
        self.stopped_at: int | None = None

    def model_time(self, step: int):
        if step != self.current:
            self._begin(step)
        return self.inner.model_time(step)

    def _begin(self, step: int) -> None:
        now = time.perf_counter()
        if self.current >= 0:
            self.step_seconds.append(now - self.started)
        self.current, self.started = step, now
        s = self.shared
        with s.lock:
            if s.stop_batch.value == self.batch_id and step >= s.stop_step.value:
                self.stopped_at = step
                raise Cancelled(f"batch {self.batch_id} stopped at step {step}")
            s.batch[self.rank], s.step[self.rank] = self.batch_id, step

    def finish(self) -> None:
        self.step_seconds.append(time.perf_counter() - self.started)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class DiTModel:
    """A Tessera DiT checkpoint (class-conditional)."""

    def __init__(self, directory: str, config, mesh):
        from tessera.diffusion.pipefusion import release_other_stages
        from tessera.train.checkpoint import load_dit

        self.model, self.config, self.mesh = load_dit(directory), config, mesh
        if config.method == "pipefusion" and config.pipefusion > 1:
            release_other_stages(self.model, config, mesh)  # each stage holds only its own blocks

    def noise_shape(self, batch: Batch) -> tuple[int, ...]:
        return (batch.images, self.model.config.in_channels, batch.height, batch.width)

    def run(self, batch: Batch, hook_for) -> tuple[list[bytes] | None, Any]:
        from PIL import Image

        from tessera.diffusion.adapters import adapter_for
        from tessera.diffusion.image_grid import to_uint8
        from tessera.diffusion.parallel import parallel_denoise
        from tessera.diffusion.sampler import initial_noise
        from tessera.diffusion.stepper import FlowStepper

        adapter = adapter_for(self.model)
        param = next(self.model.parameters())
        shape = (adapter.in_channels, batch.height, batch.width)
        # each part's noise as `tessera generate` draws it for its labels and seed
        noise = torch.cat([initial_noise((len(p.labels), *shape), p.seed, param.device, param.dtype)
                           for p in batch.parts])  # fmt: skip
        labels = torch.tensor([c for p in batch.parts for c in p.labels], device=param.device)
        hook = hook_for(FlowStepper(batch.steps))
        latents = parallel_denoise(
            self.model,
            cond={"labels": labels},
            uncond={"labels": torch.full_like(labels, adapter.null_class)},
            guidance_scale=batch.guidance,
            stepper=hook,
            noise=noise,
            config=self.config,
            mesh=self.mesh,
        )
        if self.mesh.global_rank != 0:
            return None, hook
        return [
            png_bytes(Image.fromarray(p[..., 0] if p.shape[-1] == 1 else p)) for p in to_uint8(latents)
        ], hook


class PipelineModel:
    """A saved diffusers pipeline (text-conditioned; images or videos), run by
    ``tessera.diffusion.pipelines.generate`` as `tessera generate` runs it, one image per
    (prompt, seed) of the batch; rank 0 alone holds the text encoder."""

    def __init__(self, directory: str, config, mesh, *, parallel_vae: bool = False,
                 vae_chunk_rows: int | None = None):  # fmt: skip
        from tessera.diffusion.pipefusion import release_other_stages
        from tessera.diffusion.pipeline_families import family_of
        from tessera.diffusion.pipelines import load_pipeline

        self.pipe = load_pipeline(directory, with_text_encoder=mesh.global_rank == 0)
        self.pipe.set_progress_bar_config(disable=True)
        self.family, self.config, self.mesh = family_of(type(self.pipe).__name__), config, mesh
        self.parallel_vae, self.vae_chunk_rows = parallel_vae, vae_chunk_rows
        if config.method == "pipefusion" and mesh.size("pipefusion") > 1:
            release_other_stages(self.pipe.transformer, config, mesh)  # once, for the server's life

    def images(self, batch: Batch) -> tuple[list[str], list[str], list[int]]:
        """One prompt, negative prompt and seed per image (image k of a part: seed + k)."""
        rows = [(p.prompt, p.negative_prompt, p.seed + k) for p in batch.parts for k in range(p.count)]
        return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]

    def run(self, batch: Batch, hook_for) -> tuple[list[bytes] | None, Any]:
        from tessera.diffusion.pipelines import generate

        prompts, negatives, seeds = self.images(batch)
        hooks = []
        out = generate(
            self.pipe, prompt=prompts, negative_prompt=negatives, seed=seeds, height=batch.height,
            width=batch.width, num_steps=batch.steps, guidance_scale=batch.guidance, config=self.config,
            mesh=self.mesh, release_unused=False, parallel_vae=self.parallel_vae,
            vae_chunk_rows=self.vae_chunk_rows, num_frames=batch.frames or None,
            step_hook=lambda stepper: hooks.append(hook_for(stepper)) or hooks[-1],
        )  # fmt: skip
        if self.mesh.global_rank != 0:
            return None, hooks[-1]
        if self.family.video:
            return [gif_bytes(frames) for frames in out], hooks[-1]
        return [png_bytes(image) for image in out], hooks[-1]

    def noise_shape(self, batch: Batch) -> tuple[int, ...]:
        from tessera.diffusion.pipelines import prepare_run

        noise, _ = prepare_run(self.pipe, height=batch.height, width=batch.width, num_steps=batch.steps,
                               seed=self.images(batch)[2], config=self.config, num_frames=batch.frames or None)  # fmt: skip
        return tuple(noise.shape)


def gif_bytes(frames, fps: int = 16) -> bytes:
    """A video's frames as a looping animated GIF (Wan 2.1 makes 16 frames a second)."""
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=round(1000 / fps),
                   loop=0)  # fmt: skip
    return buffer.getvalue()


def load_model(directory: str, config, mesh, vae: dict | None = None):
    """The model of ``directory`` on this rank; ``vae``: a pipeline's parallel_vae and
    vae_chunk_rows (a DiT checkpoint has no VAE)."""
    from tessera.diffusion.pipelines import is_pipeline_dir

    if is_pipeline_dir(directory):
        return PipelineModel(directory, config, mesh, **(vae or {}))
    return DiTModel(directory, config, mesh)


@dataclass
class Outcome:
    """What a rank reports for one batch."""

    rank: int
    batch_id: int
    status: str  # "done" | "cancelled"
    images: list[bytes] | None = None
    step_seconds: list[float] = field(default_factory=list)
    stopped_at: int | None = None


def _receive_batch(mesh, batch: Batch | None) -> Batch:
    """Rank 0's batch on every rank: its pickled bytes broadcast through the mesh's comm."""
    from tessera.runtime.comm import WORLD

    data = pickle.dumps(batch) if mesh.global_rank == 0 else b""
    size = mesh.comm.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=mesh.device), WORLD)
    n = int(size.item())
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(mesh.device)
        if mesh.global_rank == 0
        else torch.empty(n, dtype=torch.uint8, device=mesh.device)
    )
    mesh.comm.broadcast(buffer, WORLD)
    return batch if mesh.global_rank == 0 else pickle.loads(buffer.cpu().numpy().tobytes())


def _drain_pipefusion(model, batch: Batch, mesh, config, stopped_at: int) -> None:
    """A PipeFusion run stopped at step s > 0 leaves the last stage's latents of step s - 1
    in flight to stage 0 (sent, not yet received): stage 0 takes them, so no stale message
    is matched by the next batch's receives."""
    from tessera.diffusion.adapters import adapter_for
    from tessera.diffusion.pipefusion import AXIS, sub_bands

    degree = mesh.size(AXIS)
    if config.method != "pipefusion" or degree == 1 or stopped_at == 0 or mesh.rank(AXIS) != 0:
        return
    net = model.model if isinstance(model, DiTModel) else model.pipe.transformer
    p = adapter_for(net).patch_size
    images, channels, rows, width = model.noise_shape(batch)  # the sampler's latent: (B, C, rows, W)
    index = mesh.rank("ring") * mesh.size("ulysses") + mesh.rank("ulysses")
    for r0, r1 in sub_bands(rows // p, config.patches, config.sp, index):
        scratch = torch.empty(images, channels, (r1 - r0) * p, width, device=mesh.device,
                              dtype=next(net.parameters()).dtype)  # fmt: skip
        mesh.comm.irecv(scratch, AXIS, src=degree - 1).wait()


def rank_main(spec, directory: str, config, tasks, results, shared: Shared, vae: dict | None = None) -> None:
    """A server rank's life: join the group, load, report ready, then serve batches until
    told to stop (None). Any failure is reported with its traceback, then the rank exits:
    its peers' collectives fail instead of waiting, and the server restarts the group."""
    import traceback

    from tessera.runtime.launch import _join_group, _rank_environment

    _rank_environment(spec)
    torch.set_num_threads(spec.threads)
    rank, code = spec.rank, 0
    try:
        _join_group(spec)
        mesh = config.build_mesh()
        model = load_model(directory, config, mesh, vae)
        results.put(("ready", rank, os.getpid()))
        while (task := tasks.get()) is not None:  # rank 0: the batch; the others: a wake-up
            batch = _receive_batch(mesh, task if rank == 0 else None)
            if batch.fail_on_rank == rank:
                raise RuntimeError(f"fault drill: rank {rank} raises in batch {batch.id}")
            hook_for = lambda stepper, b=batch: StepHook(stepper, shared, rank, b.id)  # noqa: E731
            try:
                images, hook = model.run(batch, _keep(hook_for))
                hook.finish()
                results.put(("outcome", Outcome(rank, batch.id, "done", images, hook.step_seconds)))
            except Cancelled:
                # Still inside the handler, the stopped run's frames (and the last stage's
                # pending sends) are alive: stage 0 takes what is in flight, then all meet.
                hook = _keep.last
                _drain_pipefusion(model, batch, mesh, config, hook.stopped_at)
                mesh.comm.barrier()
                results.put(("outcome", Outcome(rank, batch.id, "cancelled", None, hook.step_seconds,
                                                hook.stopped_at)))  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 - the server must learn every failure
        results.put(("error", rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        code = 1
    finally:
        results.close()
        results.join_thread()  # the report is out before the process goes
    os._exit(code)


class _Keeper:
    """Remembers the last hook made, so a cancelled run's hook (raised out of) is found."""

    last: StepHook | None = None

    def __call__(self, hook_for):
        def make(stepper):
            self.last = hook_for(stepper)
            return self.last

        return make


_keep = _Keeper()
