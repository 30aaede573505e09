"""A diffusers pipeline in, parallel denoising out.

The pipeline's own parts do everything but the denoising loop: rank 0 alone loads the
text encoder and encodes the prompts, which are then broadcast; every rank draws the
same initial noise with the pipeline's ``prepare_latents`` from the seed; the loop runs
under any ParallelConfig; rank 0 decodes the latent with the VAE and returns the image.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tessera.diffusion.adapters import adapter_for
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import check_layout, check_steps, parallel_denoise
from tessera.diffusion.pipefusion import release_other_stages
from tessera.diffusion.pipeline_families import family_of
from tessera.diffusion.stepper import DiffusersStepper
from tessera.runtime.comm import WORLD
from tessera.runtime.mesh import Mesh

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]


def is_pipeline_dir(path: str | Path) -> bool:
    return (Path(path) / "model_index.json").is_file()


def _index(directory: Path) -> dict:
    import json

    if not is_pipeline_dir(directory):
        raise ValueError(f"{directory} is not a diffusers pipeline folder (no model_index.json)")
    index = json.loads((directory / "model_index.json").read_text())
    family_of(index.get("_class_name"))  # unsupported pipelines fail here, by name
    return index


def _no_text(index: dict) -> dict:
    return {k: None for k in index if k.startswith(("text_encoder", "tokenizer"))}


def load_pipeline(directory: str | Path, *, with_text_encoder: bool = True):
    """A pipeline saved with ``save_pretrained``, loaded offline. Ranks that do not encode
    prompts skip the text encoder (often the largest part)."""
    from diffusers import DiffusionPipeline

    directory = Path(directory)
    index = _index(directory)
    skip = {} if with_text_encoder else _no_text(index)
    return DiffusionPipeline.from_pretrained(directory, local_files_only=True, **skip)


def meta_pipeline(directory: str | Path):
    """The pipeline saved in ``directory`` without its weights: transformer and VAE built on
    the meta device from their configs, no text encoder. Enough for ``prepare_run``'s
    checks (sizes, layout) before any process loads the weights."""
    import diffusers
    from diffusers.utils import logging as diffusers_logging

    directory = Path(directory)
    index = _index(directory)
    parts = {}
    for name in ("transformer", "vae"):
        cls = getattr(diffusers, index[name][1])
        with torch.device("meta"):
            parts[name] = cls.from_config(cls.load_config(directory / name))
    bars = diffusers_logging.is_progress_bar_enabled()
    diffusers_logging.disable_progress_bar()  # a check, not a load: nothing to report
    try:
        # the pipeline's own class: DiffusionPipeline.from_pretrained reads the optional
        # components (WanPipeline's transformer) off DiffusionPipeline, not the pipeline, and
        # would load that part's weights from the folder in place of the one passed
        pipeline_class = getattr(diffusers, index["_class_name"])
        return pipeline_class.from_pretrained(directory, local_files_only=True, **parts, **_no_text(index))
    finally:
        if bars:
            diffusers_logging.enable_progress_bar()


def prepare_run(
    pipe,
    *,
    height: int,
    width: int,
    num_steps: int,
    seed: int | list[int],
    config: ParallelConfig,
    num_frames: int | None = None,
):
    """(initial noise, stepper) of one image (or video: ``num_frames``), after every refusal
    the run can meet (image size, frame count, the layout: attention layers, patches,
    stages; warm-up steps), before anything of ``pipe`` changes. A ``meta_pipeline`` gives
    the same refusals without weights. A video's noise is (1, C, F*H, W): frame x row rows."""
    family = family_of(type(pipe).__name__)
    if family.video:
        num_frames = family.default_frames if num_frames is None else num_frames  # 0 is refused
        family.check(pipe, num_frames)
        multiple = family.size_multiple(pipe)
        if height % multiple or width % multiple:
            raise ValueError(
                f"video size {height}x{width} is not divisible by {multiple} ({type(pipe).__name__})"
            )
    elif num_frames is not None:
        raise ValueError(
            f"--frames {num_frames}: {type(pipe).__name__} makes images; frames are for video pipelines "
            "(WanPipeline)"
        )
    vae_factor = family.vae_factor(pipe)
    if height % vae_factor or width % vae_factor:
        raise ValueError(
            f"image size {height}x{width} is not divisible by the VAE's downscale factor {vae_factor}"
        )
    video = {"num_frames": num_frames} if family.video else {}
    seeds = [seed] if isinstance(seed, int) else seed  # a batch: one seed per image
    noise = torch.cat([family.noise(pipe, height, width, s, **video) for s in seeds])
    device = pipe.transformer.device
    stepper = DiffusersStepper(
        pipe.scheduler,
        num_steps,
        device=device if device.type != "meta" else "cpu",  # timesteps are read as numbers
        **family.scheduler_kwargs(pipe, noise, num_steps),
    )
    check_layout(adapter_for(pipe.transformer), config, *noise.shape[2:])
    check_steps(config, stepper.num_steps)
    return noise, stepper


def _broadcast_tensors(mesh: Mesh, tensors: dict[str, torch.Tensor] | None, keys: tuple[str, ...]) -> dict:
    """Rank 0's tensors on every rank (shape and dtype travel first in a small header)."""
    out, device = {}, mesh.device  # NCCL moves device tensors only, headers included
    for key in keys:
        header = torch.zeros(8, dtype=torch.int64)
        if mesh.global_rank == 0:
            t = tensors[key]
            header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
            header[2 : 2 + t.dim()] = torch.tensor(t.shape)
        header = mesh.comm.broadcast(header.to(device), WORLD).cpu()
        shape = tuple(header[2 : 2 + int(header[0])].tolist())
        buffer = (
            tensors[key].contiguous().to(device)
            if mesh.global_rank == 0
            else torch.empty(shape, dtype=_DTYPES[int(header[1])], device=device)
        )
        out[key] = mesh.comm.broadcast(buffer, WORLD)
    return out


@torch.no_grad()
def generate(
    pipe,
    *,
    prompt: str | list[str],
    negative_prompt: str | list[str] = "",
    height: int,
    width: int,
    num_steps: int,
    guidance_scale: float,
    seed: int | list[int],
    config: ParallelConfig,
    mesh: Mesh | None = None,
    output_type: str = "pil",
    progress: bool = False,
    release_unused: bool = True,
    parallel_vae: bool = False,
    vae_chunk_rows: int | None = None,
    num_frames: int | None = None,
    num_images_per_prompt: int = 1,
    step_hook: Callable[[Any], Any] | None = None,
) -> Any:
    """The image for ``prompt`` on rank 0 (None on the other ranks).

    Batches: ``prompt`` a list (``negative_prompt`` one for all or one per prompt) and/or
    ``num_images_per_prompt`` > 1 make a batch of ``len(prompts) * num_images_per_prompt``
    images, prompt-major, returned as a list; image k has its own seed, ``seed + k`` (or
    ``seed[k]`` when ``seed`` is a list), so each equals the image generated alone with that
    seed — one batch through the model instead of one run per image.

    ``parallel_vae``: every rank decodes a band of the latent's rows (tessera.diffusion.
    vae_parallel) instead of rank 0 decoding it all; ``vae_chunk_rows``: the VAE's
    convolutions run over chunks of that many output rows (a lower activation peak).
    ``num_frames``: a video pipeline's frame count; it returns the video's frames (a list of
    PIL images, or a (F, 3, H, W) tensor for ``output_type="pt"``).

    ``step_hook``: called with the stepper, returns the one to sample with (a wrapper: the
    generation server's progress and cancellation, tessera.serve.generate_rank.StepHook).

    Under PipeFusion each rank first frees the transformer blocks its stage never runs
    (``release_unused``; the memory saving PipeFusion exists for): the pipeline's
    transformer is then fit for this layout only."""
    mesh = mesh or config.build_mesh()
    prompts, negatives, seeds = batch_of(prompt, negative_prompt, seed, num_images_per_prompt)
    # every refusal before any weight is freed: a refused call leaves the pipeline whole
    noise, stepper = prepare_run(
        pipe,
        height=height,
        width=width,
        num_steps=num_steps,
        seed=seeds,
        config=config,
        num_frames=num_frames,
    )
    if parallel_vae or vae_chunk_rows:
        check_vae_split(pipe, noise, mesh.size() if parallel_vae else 1, num_frames=num_frames)
    family, device = family_of(type(pipe).__name__), pipe.transformer.device
    if release_unused and config.method == "pipefusion" and mesh.size("pipefusion") > 1:
        release_other_stages(pipe.transformer, config, mesh)
    cfg = guidance_scale > 1.0 and family.classifier_free
    encoded = (
        _encode(family, pipe, prompts, negatives, cfg, num_images_per_prompt)
        if mesh.global_rank == 0
        else None
    )
    text = {k: v.to(device) for k, v in _broadcast_tensors(mesh, encoded, family.keys(cfg)).items()}
    video = {"num_frames": num_frames or family.default_frames} if family.video else {}
    cond, uncond, scale = family.conditions(pipe, text, cfg, height, width, guidance_scale, **video)
    cond, uncond = _batched(cond, len(seeds)), (None if uncond is None else _batched(uncond, len(seeds)))
    latents = parallel_denoise(
        pipe.transformer,
        cond=cond,
        uncond=uncond,
        guidance_scale=scale,
        stepper=step_hook(stepper) if step_hook else stepper,
        noise=noise,
        config=config,
        mesh=mesh,
        progress=progress,
    )
    if parallel_vae or vae_chunk_rows:
        decoded = _decode_split(pipe, family, latents, mesh, parallel_vae, vae_chunk_rows, video)
    else:
        decoded = family.decode(pipe, latents, **video) if mesh.global_rank == 0 else None
    if mesh.global_rank != 0:
        return None
    images = family.postprocess(pipe, decoded, output_type)
    single = isinstance(prompt, str) and num_images_per_prompt == 1 and isinstance(seed, int)
    return images[0] if single else images


def batch_of(prompt, negative_prompt, seed, num_images_per_prompt: int):
    """(prompts, negative prompts, one seed per image), checked."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompt must be a string or a non-empty list of strings, got {prompt!r}")
    if isinstance(negative_prompt, str):
        negatives = [negative_prompt] * len(prompts)
    else:
        negatives = list(negative_prompt)
        if len(negatives) != len(prompts):
            raise ValueError(
                f"{len(negatives)} negative prompts for {len(prompts)} prompts; give one per prompt or one string"
            )
    if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
        raise ValueError(f"num_images_per_prompt must be an integer >= 1, got {num_images_per_prompt!r}")
    batch = len(prompts) * num_images_per_prompt
    seeds = [seed + k for k in range(batch)] if isinstance(seed, int) else list(seed)
    if len(seeds) != batch:
        raise ValueError(f"{len(seeds)} seeds for a batch of {batch} images; give one per image or one int")
    return prompts, negatives, seeds


def _encode(family, pipe, prompts, negatives, cfg: bool, per_prompt: int) -> dict[str, torch.Tensor]:
    """Each prompt encoded alone (as when it is generated alone), stacked, each repeated
    ``per_prompt`` times."""
    parts = [family.encode(pipe, p, n, cfg) for p, n in zip(prompts, negatives, strict=True)]
    return {k: torch.cat([part[k] for part in parts]).repeat_interleave(per_prompt, dim=0) for k in parts[0]}


def _batched(cond: dict[str, torch.Tensor], batch: int) -> dict[str, torch.Tensor]:
    """The families make per-call conditioning (image size, Flux guidance, frame count)
    for one image: widened to the batch; per-prompt tensors already have it."""
    return {k: v.expand(batch, *v.shape[1:]) if v.shape[0] == 1 and batch > 1 else v for k, v in cond.items()}


def check_vae_split(pipe, noise: torch.Tensor, ranks: int, *, num_frames: int | None = None) -> None:
    """What a parallel or chunked VAE decode of this run would refuse (the VAE's class and
    configuration, a latent with fewer rows than ranks), before anything runs. A video's
    noise holds frame x row rows: its frames' own rows are what the VAE splits."""
    from tessera.diffusion.vae_parallel import check_vae

    check_vae(pipe.vae)
    family = family_of(type(pipe).__name__)
    rows = noise.shape[-2]
    if family.video:
        rows //= family.latent_frames(pipe, num_frames or family.default_frames)
    if rows < ranks:
        raise ValueError(
            f"--parallel-vae: a latent of {rows} rows cannot be split over {ranks} ranks; "
            f"use at most {rows} processes or decode serially"
        )


def _decode_split(
    pipe, family, latents: torch.Tensor, mesh: Mesh, parallel: bool, chunk_rows: int | None, video: dict
):
    """The decoded image on rank 0 (None elsewhere): every rank decoding a band of rows
    (``parallel``), or rank 0 alone, chunk by chunk."""
    from tessera.diffusion.vae_parallel import VaeSplit, decode_rows

    if parallel and mesh.size() > 1:
        split = VaeSplit(mesh=Mesh(vae=mesh.size()), chunk_rows=chunk_rows)
    elif mesh.global_rank == 0:
        split = VaeSplit(chunk_rows=chunk_rows)
    else:
        return None
    return decode_rows(pipe.vae, family.vae_input(pipe, latents, **video), split)
