"""Per pipeline family: how to encode prompts, draw the initial noise, set the scheduler
and decode, exactly as that diffusers pipeline's ``__call__`` does, so a parallel run
reproduces the pipeline's image for the same seed."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _text_device(pipe) -> torch.device:
    """Where the pipeline's own ``__call__`` encodes prompts: its execution device (the text
    encoders' device; PixArt and SD3 move the token ids there themselves, so a device other
    than the encoders' fails on a GPU)."""
    return pipe._execution_device


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _calculate_shift(scheduler, image_seq_len: int, max_shift_default: float) -> float:
    """The resolution-dependent timestep shift (mu) of SD3 / Flux pipelines."""
    c = scheduler.config
    base_len, max_len = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
    base_shift, max_shift = c.get("base_shift", 0.5), c.get("max_shift", max_shift_default)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


class PixArtFamily:
    names = ("PixArtAlphaPipeline", "PixArtSigmaPipeline")
    classifier_free = True  # guidance by a second (negative-prompt) branch
    video = False

    def vae_factor(self, pipe) -> int:
        """Pixels per latent pixel (height and width)."""
        return pipe.vae_scale_factor

    def postprocess(self, pipe, decoded: torch.Tensor, output_type: str) -> list:
        """Every image of the batch."""
        return list(pipe.image_processor.postprocess(decoded, output_type=output_type))

    def keys(self, cfg: bool) -> tuple[str, ...]:
        keys = ("prompt_embeds", "prompt_attention_mask")
        return keys + tuple(f"negative_{k}" for k in keys) if cfg else keys

    def encode(self, pipe, prompt: str, negative_prompt: str, cfg: bool) -> dict[str, torch.Tensor]:
        embeds, mask, neg, neg_mask = pipe.encode_prompt(
            prompt,
            do_classifier_free_guidance=cfg,
            negative_prompt=negative_prompt,
            device=_text_device(pipe),
            clean_caption=False,
        )
        out = {"prompt_embeds": embeds, "prompt_attention_mask": mask}
        return (
            out | {"negative_prompt_embeds": neg, "negative_prompt_attention_mask": neg_mask} if cfg else out
        )

    def conditions(self, pipe, text: dict, cfg: bool, height: int, width: int, guidance_scale: float):
        dtype, device = pipe.transformer.dtype, pipe.transformer.device
        branches = [
            {
                "prompt_embeds": text["prompt_embeds"].to(dtype),
                "prompt_attention_mask": text["prompt_attention_mask"],
            }
        ]
        if cfg:
            branches.append(
                {
                    "prompt_embeds": text["negative_prompt_embeds"].to(dtype),
                    "prompt_attention_mask": text["negative_prompt_attention_mask"],
                }
            )
        if pipe.transformer.config.sample_size == 128:  # the 1024-px models take the size as a condition
            for branch in branches:
                branch["resolution"] = torch.tensor([[height, width]], dtype=dtype, device=device)
                branch["aspect_ratio"] = torch.tensor([[height / width]], dtype=dtype, device=device)
        return branches[0], (branches[1] if cfg else None), guidance_scale if cfg else 1.0

    def noise(self, pipe, height: int, width: int, seed: int) -> torch.Tensor:
        t = pipe.transformer
        return pipe.prepare_latents(
            1, t.config.in_channels, height, width, t.dtype, t.device, _generator(seed)
        )

    def scheduler_kwargs(self, pipe, noise: torch.Tensor, num_steps: int) -> dict[str, Any]:
        return {}

    def vae_input(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        """The denoised latent as the pipeline hands it to ``vae.decode``."""
        return latents / pipe.vae.config.scaling_factor

    def decode(self, pipe, latents: torch.Tensor, **video) -> torch.Tensor:
        return pipe.vae.decode(self.vae_input(pipe, latents, **video), return_dict=False)[0]


class SD3Family(PixArtFamily):
    names = ("StableDiffusion3Pipeline",)

    def keys(self, cfg: bool) -> tuple[str, ...]:
        keys = ("prompt_embeds", "pooled_prompt_embeds")
        return keys + tuple(f"negative_{k}" for k in keys) if cfg else keys

    def encode(self, pipe, prompt: str, negative_prompt: str, cfg: bool) -> dict[str, torch.Tensor]:
        embeds, neg, pooled, neg_pooled = pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            prompt_3=None,
            device=_text_device(pipe),
            do_classifier_free_guidance=cfg,
            negative_prompt=negative_prompt,
        )
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        return (
            out | {"negative_prompt_embeds": neg, "negative_pooled_prompt_embeds": neg_pooled} if cfg else out
        )

    def conditions(self, pipe, text: dict, cfg: bool, height: int, width: int, guidance_scale: float):
        dtype = pipe.transformer.dtype
        cond = {k: text[k].to(dtype) for k in ("prompt_embeds", "pooled_prompt_embeds")}
        uncond = {k: text[f"negative_{k}"].to(dtype) for k in cond} if cfg else None
        return cond, uncond, guidance_scale if cfg else 1.0

    def scheduler_kwargs(self, pipe, noise: torch.Tensor, num_steps: int) -> dict[str, Any]:
        if not pipe.scheduler.config.get("use_dynamic_shifting", None):
            return {}
        p = pipe.transformer.config.patch_size
        return {"mu": _calculate_shift(pipe.scheduler, (noise.shape[2] // p) * (noise.shape[3] // p), 1.16)}

    def vae_input(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        c = pipe.vae.config
        return latents / c.scaling_factor + c.shift_factor


class FluxFamily(SD3Family):
    """Flux-dev's guidance is an embedding (no second branch); Flux-schnell has none."""

    names = ("FluxPipeline",)
    classifier_free = False

    def keys(self, cfg: bool) -> tuple[str, ...]:
        return ("prompt_embeds", "pooled_prompt_embeds")

    def encode(self, pipe, prompt: str, negative_prompt: str, cfg: bool) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=_text_device(pipe))
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def conditions(self, pipe, text: dict, cfg: bool, height: int, width: int, guidance_scale: float):
        t = pipe.transformer
        cond = {k: text[k].to(t.dtype) for k in ("prompt_embeds", "pooled_prompt_embeds")}
        if t.config.guidance_embeds:
            cond["guidance"] = torch.full([1], guidance_scale, dtype=torch.float32, device=t.device)
        return cond, None, 1.0

    def noise(self, pipe, height: int, width: int, seed: int) -> torch.Tensor:
        t = pipe.transformer
        packed, _ = pipe.prepare_latents(
            1, t.config.in_channels // 4, height, width, t.dtype, t.device, _generator(seed)
        )
        return pipe._unpack_latents(packed, height, width, pipe.vae_scale_factor)

    def scheduler_kwargs(self, pipe, noise: torch.Tensor, num_steps: int) -> dict[str, Any]:
        use_flow_sigmas = getattr(pipe.scheduler.config, "use_flow_sigmas", False)
        sigmas = None if use_flow_sigmas else np.linspace(1.0, 1 / num_steps, num_steps)
        tokens = (noise.shape[2] // 2) * (noise.shape[3] // 2)
        return {"sigmas": sigmas, "mu": _calculate_shift(pipe.scheduler, tokens, 1.15)}


class WanFamily(PixArtFamily):
    """Wan 2.1 text-to-video. The samplers see the latent (1, C, F, H, W) as the image
    (1, C, F*H, W) (frame x row rows; see adapters/wan.py); ``vae_input`` folds it back."""

    names = ("WanPipeline",)
    video = True
    max_sequence_length = 512  # WanPipeline.__call__'s defaults
    default_frames = 81
    default_size = (480, 832)

    def vae_factor(self, pipe) -> int:
        return pipe.vae_scale_factor_spatial

    def size_multiple(self, pipe) -> int:
        """WanPipeline.check_inputs asks height and width divisible by 16; patches need
        the VAE factor times the patch size."""
        return max(16, pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1])

    def check(self, pipe, num_frames: int) -> None:
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("boundary_ratio") is not None:
            raise ValueError("WanPipeline with a second transformer (Wan 2.2) is not supported; Wan 2.1 is")
        if pipe.config.get("expand_timesteps"):
            raise ValueError("WanPipeline with expand_timesteps (Wan 2.2 TI2V) is not supported; Wan 2.1 is")
        k = pipe.vae_scale_factor_temporal
        if num_frames < 1 or (num_frames - 1) % k:
            below = max(1, (num_frames - 1) // k * k + 1)
            raise ValueError(
                f"--frames {num_frames}: this Wan VAE compresses time {k}x, so it takes {k}k+1 frames "
                f"(e.g. {below} or {below + k})"
            )

    def latent_frames(self, pipe, num_frames: int) -> int:
        return (num_frames - 1) // pipe.vae_scale_factor_temporal + 1

    def keys(self, cfg: bool) -> tuple[str, ...]:
        return ("prompt_embeds", "negative_prompt_embeds") if cfg else ("prompt_embeds",)

    def encode(self, pipe, prompt: str, negative_prompt: str, cfg: bool) -> dict[str, torch.Tensor]:
        embeds, neg = pipe.encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=cfg,
            max_sequence_length=self.max_sequence_length,
            device=_text_device(pipe),
        )
        return {"prompt_embeds": embeds} | ({"negative_prompt_embeds": neg} if cfg else {})

    def conditions(
        self, pipe, text: dict, cfg: bool, height: int, width: int, guidance_scale: float, num_frames: int = 1
    ):
        t = pipe.transformer
        frames = torch.full([1], self.latent_frames(pipe, num_frames), dtype=torch.int64, device=t.device)
        cond = {"prompt_embeds": text["prompt_embeds"].to(t.dtype), "latent_frames": frames}
        uncond = {"prompt_embeds": text["negative_prompt_embeds"].to(t.dtype), "latent_frames": frames}
        return cond, (uncond if cfg else None), guidance_scale if cfg else 1.0

    def noise(self, pipe, height: int, width: int, seed: int, num_frames: int = 1) -> torch.Tensor:
        t = pipe.transformer
        latents = pipe.prepare_latents(
            1, t.config.in_channels, height, width, num_frames, torch.float32, t.device, _generator(seed)
        )
        b, c, f, h, w = latents.shape
        return latents.reshape(b, c, f * h, w)

    def vae_input(self, pipe, latents: torch.Tensor, num_frames: int = 1) -> torch.Tensor:
        vae = pipe.vae
        b, c, rows, w = latents.shape
        frames = self.latent_frames(pipe, num_frames)
        video = latents.reshape(b, c, frames, rows // frames, w).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(video)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(video)
        return video / inv_std + mean

    def postprocess(self, pipe, decoded: torch.Tensor, output_type: str) -> list:
        """Every video of the batch: its frames as a list of PIL images ("pil") or a
        (F, 3, H, W) tensor ("pt")."""
        return list(pipe.video_processor.postprocess_video(decoded, output_type=output_type))


class LTXFamily(WanFamily):
    """LTX-Video (LTXPipeline): like Wan, the latent is (1, C, F*H, W) to the samplers; the
    pipeline's own latents are packed tokens, unpacked here."""

    names = ("LTXPipeline",)
    max_sequence_length = 128  # LTXPipeline.__call__'s defaults
    default_frames = 161
    default_size = (512, 704)
    frame_rate = 25

    def vae_factor(self, pipe) -> int:
        return pipe.vae_spatial_compression_ratio

    def size_multiple(self, pipe) -> int:
        return 32  # LTXPipeline.check_inputs

    def check(self, pipe, num_frames: int) -> None:
        if pipe.vae.config.timestep_conditioning:
            raise ValueError(
                "LTXPipeline with a timestep-conditioned VAE (LTX-Video 0.9.1+, noise added before decoding) is "
                "not supported; LTX-Video 0.9's is"
            )
        k = pipe.vae_temporal_compression_ratio
        if num_frames < 1 or (num_frames - 1) % k:
            below = max(1, (num_frames - 1) // k * k + 1)
            raise ValueError(
                f"--frames {num_frames}: this LTX VAE compresses time {k}x, so it takes {k}k+1 frames "
                f"(e.g. {below} or {below + k})"
            )

    def latent_frames(self, pipe, num_frames: int) -> int:
        return (num_frames - 1) // pipe.vae_temporal_compression_ratio + 1

    def keys(self, cfg: bool) -> tuple[str, ...]:
        keys = ("prompt_embeds", "prompt_attention_mask")
        return keys + tuple(f"negative_{k}" for k in keys) if cfg else keys

    def encode(self, pipe, prompt: str, negative_prompt: str, cfg: bool) -> dict[str, torch.Tensor]:
        embeds, mask, neg, neg_mask = pipe.encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=cfg,
            max_sequence_length=self.max_sequence_length,
            device=_text_device(pipe),
        )
        out = {"prompt_embeds": embeds, "prompt_attention_mask": mask}
        return (
            out | {"negative_prompt_embeds": neg, "negative_prompt_attention_mask": neg_mask} if cfg else out
        )

    def conditions(
        self, pipe, text: dict, cfg: bool, height: int, width: int, guidance_scale: float, num_frames: int = 1
    ):
        t = pipe.transformer
        s = pipe.vae_spatial_compression_ratio
        shared = {
            "latent_frames": torch.full(
                [1], self.latent_frames(pipe, num_frames), dtype=torch.int64, device=t.device
            ),
            "rope_interpolation_scale": torch.tensor(
                [[pipe.vae_temporal_compression_ratio / self.frame_rate, s, s]], device=t.device
            ),
        }

        def branch(prefix: str) -> dict:
            return {
                "prompt_embeds": text[f"{prefix}prompt_embeds"].to(t.dtype),
                "prompt_attention_mask": text[f"{prefix}prompt_attention_mask"],
            } | shared

        return branch(""), (branch("negative_") if cfg else None), guidance_scale if cfg else 1.0

    def noise(self, pipe, height: int, width: int, seed: int, num_frames: int = 1) -> torch.Tensor:
        t = pipe.transformer
        packed = pipe.prepare_latents(
            1, t.config.in_channels, height, width, num_frames, torch.float32, t.device, _generator(seed)
        )
        s = pipe.vae_spatial_compression_ratio
        frames, h, w = self.latent_frames(pipe, num_frames), height // s, width // s
        video = pipe._unpack_latents(packed, frames, h, w, 1, 1)
        return video.reshape(1, video.shape[1], frames * h, w)

    def scheduler_kwargs(self, pipe, noise: torch.Tensor, num_steps: int) -> dict[str, Any]:
        tokens = noise.shape[2] * noise.shape[3]  # one token per latent pixel
        return {
            "sigmas": np.linspace(1.0, 1 / num_steps, num_steps),
            "mu": _calculate_shift(pipe.scheduler, tokens, 1.15),
        }

    def vae_input(self, pipe, latents: torch.Tensor, num_frames: int = 1) -> torch.Tensor:
        vae = pipe.vae
        b, c, rows, w = latents.shape
        frames = self.latent_frames(pipe, num_frames)
        video = latents.reshape(b, c, frames, rows // frames, w)
        return pipe._denormalize_latents(
            video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        ).to(vae.dtype)

    def decode(self, pipe, latents: torch.Tensor, **video) -> torch.Tensor:
        return pipe.vae.decode(self.vae_input(pipe, latents, **video), None, return_dict=False)[0]


FAMILIES = [PixArtFamily(), SD3Family(), FluxFamily(), WanFamily(), LTXFamily()]


def family_of(class_name: str):
    for family in FAMILIES:
        if class_name in family.names:
            return family
    supported = ", ".join(n for f in FAMILIES for n in f.names)
    raise ValueError(f"pipeline {class_name} is not supported yet; supported: {supported}")
