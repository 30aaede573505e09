"""diffusers' FluxTransformer2DModel (tiny Flux-dev-style config: guidance embedding,
double- and single-stream blocks, RoPE; random weights) under every parallel layout
against the loop FluxPipeline runs on packed latents (with true CFG)."""

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from parity import check_layouts, exact_two_rank_layouts, joint_inputs, perturbed, stale_two_rank_layouts

from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_denoise
from tessera.diffusion.stale_reference import stale_reference_denoise
from tessera.diffusion.stepper import DiffusersStepper
from tessera.runtime import spawn

STEPS, TRUE_CFG, DISTILLED_GUIDANCE, BATCH, H, W = 4, 2.0, 3.5, 1, 16, 12


def tiny_flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=24,
        pooled_projection_dim=16,
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )
    return perturbed(model)


def scheduler_and_kwargs():
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    sigmas = np.linspace(1.0, 1 / STEPS, STEPS)
    return scheduler, {"sigmas": sigmas, "mu": 0.8}  # mu: the pipeline derives it from the token count


def inputs() -> dict[str, torch.Tensor]:
    return joint_inputs(BATCH)


@torch.no_grad()
def pipeline_loop(model, data) -> torch.Tensor:
    """What FluxPipeline.__call__ does between encoding and decoding (packed latents)."""
    scheduler, kwargs = scheduler_and_kwargs()
    scheduler.set_timesteps(sigmas=kwargs["sigmas"], mu=kwargs["mu"])
    # The pipeline's own packing and ids (Tessera's adapter has its own; this checks them).
    latents = FluxPipeline._pack_latents(data["noise"], BATCH, 4, H, W)
    img_ids = FluxPipeline._prepare_latent_image_ids(BATCH, H // 2, W // 2, "cpu", torch.float32)
    common = dict(
        guidance=torch.full([BATCH], DISTILLED_GUIDANCE),
        txt_ids=torch.zeros(6, 3),
        img_ids=img_ids,
        return_dict=False,
    )
    for t in scheduler.timesteps:
        timestep = t.expand(BATCH) / 1000
        cond = model(
            hidden_states=latents,
            timestep=timestep,
            pooled_projections=data["pooled"],
            encoder_hidden_states=data["text"],
            **common,
        )[0]
        uncond = model(
            hidden_states=latents,
            timestep=timestep,
            pooled_projections=data["negative_pooled"],
            encoder_hidden_states=data["negative"],
            **common,
        )[0]
        latents = scheduler.step(uncond + TRUE_CFG * (cond - uncond), t, latents, return_dict=False)[0]
    return FluxPipeline._unpack_latents(latents, H * 8, W * 8, 8)  # (height, width in pixels, VAE factor)


def _denoise(layouts: dict[str, ParallelConfig], reference: bool = False) -> dict[str, torch.Tensor]:
    """Each layout's latent; with ``reference``, the plain stale-K/V reference's instead."""
    model, data = tiny_flux(), inputs()
    run = stale_reference_denoise if reference else parallel_denoise
    guidance = torch.full([BATCH], DISTILLED_GUIDANCE)
    out = {}
    for name, config in layouts.items():
        scheduler, kwargs = scheduler_and_kwargs()
        out[name] = run(
            model,
            cond={
                "prompt_embeds": data["text"],
                "pooled_prompt_embeds": data["pooled"],
                "guidance": guidance,
            },
            uncond={
                "prompt_embeds": data["negative"],
                "pooled_prompt_embeds": data["negative_pooled"],
                "guidance": guidance,
            },
            guidance_scale=TRUE_CFG,
            stepper=DiffusersStepper(scheduler, STEPS, **kwargs),
            noise=data["noise"],
            config=config,
        )
    return out


def test_flux_layouts_match_the_pipeline_loop():
    expected = pipeline_loop(tiny_flux(), inputs())
    single = {"serial": ParallelConfig(), "patches": ParallelConfig(patches=3, warmup_steps=STEPS)}
    stale = stale_two_rank_layouts() | {"patches3_warmup0": ParallelConfig(patches=3, warmup_steps=0)}
    references = _denoise(stale, reference=True)
    check_layouts(_denoise(single | {"patches3_warmup0": stale["patches3_warmup0"]}), expected, references)
    for rank in spawn(_denoise, 2, exact_two_rank_layouts(STEPS) | stale_two_rank_layouts(), timeout_s=300):
        check_layouts(rank, expected, references)
