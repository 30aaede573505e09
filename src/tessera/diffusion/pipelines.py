"""A diffusers pipeline in, parallel denoising out.

The pipeline's own parts do everything but the denoising loop: rank 0 alone loads the
text encoder and encodes the prompts, which are then broadcast; every rank draws the
same initial noise with the pipeline's ``prepare_latents`` from the seed; the loop runs
under any ParallelConfig; rank 0 decodes the latent with the VAE and returns the image.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_denoise
from tessera.diffusion.stepper import DiffusersStepper
from tessera.runtime.comm import WORLD
from tessera.runtime.mesh import Mesh

log = logging.getLogger(__name__)

SUPPORTED = ("PixArtAlphaPipeline", "PixArtSigmaPipeline")
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]


def is_pipeline_dir(path: str | Path) -> bool:
    return (Path(path) / "model_index.json").is_file()


def load_pipeline(directory: str | Path, *, with_text_encoder: bool = True):
    """A pipeline saved with ``save_pretrained``, loaded offline. Ranks that do not encode
    prompts skip the text encoder (often the largest part)."""
    import json

    from diffusers import DiffusionPipeline

    directory = Path(directory)
    if not is_pipeline_dir(directory):
        raise ValueError(f"{directory} is not a diffusers pipeline folder (no model_index.json)")
    class_name = json.loads((directory / "model_index.json").read_text()).get("_class_name")
    if class_name not in SUPPORTED:
        raise ValueError(f"pipeline {class_name} is not supported yet; supported: {', '.join(SUPPORTED)}")
    skip = {} if with_text_encoder else {"text_encoder": None, "tokenizer": None}
    return DiffusionPipeline.from_pretrained(directory, local_files_only=True, **skip)


def _broadcast_tensors(mesh: Mesh, tensors: dict[str, torch.Tensor] | None, keys: tuple[str, ...]) -> dict:
    """Rank 0's tensors on every rank (shape and dtype travel first in a small header)."""
    out = {}
    for key in keys:
        header = torch.zeros(8, dtype=torch.int64)
        if mesh.global_rank == 0:
            t = tensors[key]
            header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
            header[2 : 2 + t.dim()] = torch.tensor(t.shape)
        mesh.comm.broadcast(header, WORLD)
        shape = tuple(header[2 : 2 + int(header[0])].tolist())
        buffer = (
            tensors[key].contiguous()
            if mesh.global_rank == 0
            else torch.empty(shape, dtype=_DTYPES[int(header[1])])
        )
        out[key] = mesh.comm.broadcast(buffer, WORLD)
    return out


def _encode(pipe, prompt: str, negative_prompt: str, guidance_scale: float) -> dict[str, torch.Tensor]:
    embeds, mask, neg_embeds, neg_mask = pipe.encode_prompt(
        prompt,
        do_classifier_free_guidance=guidance_scale > 1.0,
        negative_prompt=negative_prompt,
        device=torch.device("cpu"),
        clean_caption=False,
    )
    out = {"prompt_embeds": embeds, "prompt_attention_mask": mask}
    if guidance_scale > 1.0:
        out |= {"negative_prompt_embeds": neg_embeds, "negative_prompt_attention_mask": neg_mask}
    return out


@torch.no_grad()
def generate(
    pipe,
    *,
    prompt: str,
    negative_prompt: str = "",
    height: int,
    width: int,
    num_steps: int,
    guidance_scale: float,
    seed: int,
    config: ParallelConfig,
    mesh: Mesh | None = None,
    output_type: str = "pil",
    progress: bool = False,
) -> Any:
    """The image for ``prompt`` on rank 0 (None on the other ranks)."""
    mesh = mesh or config.build_mesh()
    scale = pipe.vae_scale_factor
    if height % scale or width % scale:
        raise ValueError(
            f"image size {height}x{width} is not divisible by the VAE's downscale factor {scale}"
        )
    keys = ("prompt_embeds", "prompt_attention_mask")
    if guidance_scale > 1.0:
        keys += ("negative_prompt_embeds", "negative_prompt_attention_mask")
    encoded = _encode(pipe, prompt, negative_prompt, guidance_scale) if mesh.global_rank == 0 else None
    text = _broadcast_tensors(mesh, encoded, keys)
    transformer = pipe.transformer
    device, dtype = transformer.device, transformer.dtype
    text = {k: v.to(device) for k, v in text.items()}
    cond = {
        "prompt_embeds": text["prompt_embeds"].to(dtype),
        "prompt_attention_mask": text["prompt_attention_mask"],
    }
    uncond = None
    if guidance_scale > 1.0:
        uncond = {
            "prompt_embeds": text["negative_prompt_embeds"].to(dtype),
            "prompt_attention_mask": text["negative_prompt_attention_mask"],
        }
    if transformer.config.sample_size == 128:  # PixArt's 1024-px models take the size as a condition
        for branch in filter(None, (cond, uncond)):
            branch["resolution"] = torch.tensor([[height, width]], dtype=dtype, device=device)
            branch["aspect_ratio"] = torch.tensor([[height / width]], dtype=dtype, device=device)
    noise = pipe.prepare_latents(
        1, transformer.config.in_channels, height, width, dtype, device, torch.Generator().manual_seed(seed)
    )
    stepper = DiffusersStepper(pipe.scheduler, num_steps, device=device)
    latents = parallel_denoise(
        transformer,
        cond=cond,
        uncond=uncond,
        guidance_scale=max(guidance_scale, 1.0),
        stepper=stepper,
        noise=noise,
        config=config,
        mesh=mesh,
        progress=progress,
    )
    if mesh.global_rank != 0:
        return None
    image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type=output_type)[0]
