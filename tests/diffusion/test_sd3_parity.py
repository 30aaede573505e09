"""diffusers' SD3Transformer2DModel (tiny SD3.5-style config: a dual-attention layer and
q/k RMS norm, random weights) under every parallel layout against the loop
StableDiffusion3Pipeline runs. Joint text+image attention: the text stream must be right
for every band and patch."""

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from parity import check_layouts, exact_two_rank_layouts, joint_inputs, perturbed, stale_two_rank_layouts

from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_denoise
from tessera.diffusion.stale_reference import stale_reference_denoise
from tessera.diffusion.stepper import DiffusersStepper
from tessera.runtime import spawn

STEPS, GUIDANCE, BATCH = 4, 3.0, 1


def tiny_sd3() -> SD3Transformer2DModel:
    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=24,
        caption_projection_dim=32,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
    return perturbed(model)


def inputs() -> dict[str, torch.Tensor]:
    return joint_inputs(BATCH)


@torch.no_grad()
def pipeline_loop(model, data) -> torch.Tensor:
    """What StableDiffusion3Pipeline.__call__ does between encoding and decoding."""
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(STEPS)
    x = data["noise"].clone()
    text = torch.cat([data["negative"], data["text"]])
    pooled = torch.cat([data["negative_pooled"], data["pooled"]])
    for t in scheduler.timesteps:
        out = model(
            hidden_states=torch.cat([x, x]),
            timestep=t.expand(2 * BATCH),
            encoder_hidden_states=text,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        uncond, cond = out.chunk(2)
        x = scheduler.step(uncond + GUIDANCE * (cond - uncond), t, x, return_dict=False)[0]
    return x


def _denoise(layouts: dict[str, ParallelConfig], reference: bool = False) -> dict[str, torch.Tensor]:
    """Each layout's latent; with ``reference``, the plain stale-K/V reference's instead."""
    model, data = tiny_sd3(), inputs()
    run = stale_reference_denoise if reference else parallel_denoise
    return {
        name: run(
            model,
            cond={"prompt_embeds": data["text"], "pooled_prompt_embeds": data["pooled"]},
            uncond={"prompt_embeds": data["negative"], "pooled_prompt_embeds": data["negative_pooled"]},
            guidance_scale=GUIDANCE,
            stepper=DiffusersStepper(FlowMatchEulerDiscreteScheduler(), STEPS),
            noise=data["noise"],
            config=config,
        )
        for name, config in layouts.items()
    }


def test_sd3_layouts_match_the_pipeline_loop():
    expected = pipeline_loop(tiny_sd3(), inputs())
    single = {"serial": ParallelConfig(), "patches": ParallelConfig(patches=3, warmup_steps=STEPS)}
    stale = stale_two_rank_layouts() | {"patches3_warmup1": ParallelConfig(patches=3, warmup_steps=1)}
    references = _denoise(stale, reference=True)
    check_layouts(_denoise(single | {"patches3_warmup1": stale["patches3_warmup1"]}), expected, references)
    for rank in spawn(_denoise, 2, exact_two_rank_layouts(STEPS) | stale_two_rank_layouts(), timeout_s=300):
        check_layouts(rank, expected, references)


def test_sd3_pipefusion_with_sequence_parallel_stages():
    """PipeFusion x Ulysses, x Ring and x CFG on 4 ranks: joint attention with the text
    stream through the stale-K/V buffer and the USP kernel inside each stage, exact with
    warm-up = all steps and equal to the stale reference with warm-up 0 and 1."""
    expected = pipeline_loop(tiny_sd3(), inputs())
    exact = {
        "pipefusion2_ulysses2": ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=STEPS),
        "pipefusion2_ring2": ParallelConfig(pipefusion=2, ring=2, warmup_steps=STEPS),
    }
    stale = {
        "pipefusion2_ulysses2_warmup1": ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=1),
        "pipefusion2_ring2_warmup0": ParallelConfig(
            pipefusion=2, ring=2, patches=4, warmup_steps=0
        ),
        "cfg2_pipefusion2_warmup1": ParallelConfig(
            cfg_parallel=True, pipefusion=2, patches=3, warmup_steps=1
        ),
    }
    references = _denoise(stale, reference=True)
    for rank in spawn(_denoise, 4, exact | stale, timeout_s=300):
        check_layouts(rank, expected, references)
