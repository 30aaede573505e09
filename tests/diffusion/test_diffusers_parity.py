"""diffusers' PixArtTransformer2DModel (tiny config, random weights) under every parallel
layout against the loop diffusers' own PixArtAlphaPipeline runs (forward + scheduler)."""

import torch
from diffusers import DPMSolverMultistepScheduler
from parity import check_layouts, exact_two_rank_layouts, stale_two_rank_layouts
from tiny_pipelines import tiny_pixart_transformer

from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_denoise
from tessera.diffusion.stale_reference import stale_reference_denoise
from tessera.diffusion.stepper import DiffusersStepper
from tessera.runtime import spawn

STEPS, GUIDANCE, BATCH = 4, 3.0, 2


def tiny_pixart():
    torch.manual_seed(0)
    return tiny_pixart_transformer()


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(BATCH, 5)
    mask[:, -2:] = 0  # padded caption tokens must stay masked in every layout
    return {
        "text": torch.randn(BATCH, 5, 24, generator=g),
        "negative": torch.randn(BATCH, 5, 24, generator=g),
        "mask": mask,
        "noise": torch.randn(BATCH, 4, 16, 12, generator=g),
    }


@torch.no_grad()
def pipeline_loop(model, data) -> torch.Tensor:
    """What PixArtAlphaPipeline.__call__ does between encoding the prompt and decoding."""
    scheduler = DPMSolverMultistepScheduler()
    scheduler.set_timesteps(STEPS)
    x = data["noise"].clone()
    for t in scheduler.timesteps:
        x_in = scheduler.scale_model_input(torch.cat([x, x]), t)
        out = model(
            x_in,
            encoder_hidden_states=torch.cat([data["negative"], data["text"]]),
            encoder_attention_mask=torch.cat([data["mask"], data["mask"]]),
            timestep=t.expand(2 * BATCH),
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
            return_dict=False,
        )[0]
        uncond, cond = out.chunk(2)
        out = (uncond + GUIDANCE * (cond - uncond)).chunk(2, dim=1)[0]
        x = scheduler.step(out, t, x, return_dict=False)[0]
    return x


def _denoise(layouts: dict[str, ParallelConfig], reference: bool = False) -> dict[str, torch.Tensor]:
    """Each layout's latent; with ``reference``, the plain stale-K/V reference's instead."""
    model, data = tiny_pixart(), inputs()
    run = stale_reference_denoise if reference else parallel_denoise
    return {
        name: run(
            model,
            cond={"prompt_embeds": data["text"], "prompt_attention_mask": data["mask"]},
            uncond={"prompt_embeds": data["negative"], "prompt_attention_mask": data["mask"]},
            guidance_scale=GUIDANCE,
            stepper=DiffusersStepper(DPMSolverMultistepScheduler(), STEPS),
            noise=data["noise"],
            config=config,
        )
        for name, config in layouts.items()
    }


def test_pixart_layouts_match_the_pipeline_loop():
    expected = pipeline_loop(tiny_pixart(), inputs())
    (serial,) = _denoise({"serial": ParallelConfig()}).values()
    torch.testing.assert_close(serial, expected, rtol=0, atol=0)  # same ops in the same order
    stale = stale_two_rank_layouts() | {"patches3_warmup0": ParallelConfig(patches=3, warmup_steps=0)}
    references = _denoise(stale, reference=True)
    check_layouts(_denoise({"patches3_warmup0": stale["patches3_warmup0"]}), expected, references)
    for rank in spawn(_denoise, 2, exact_two_rank_layouts(STEPS) | stale_two_rank_layouts(), timeout_s=300):
        check_layouts(rank, expected, references)


def test_scheduler_stepped_per_slice_equals_the_whole():
    """What every parallel sampler relies on: a multistep solver stepped on slices of the
    latent, each with its own state, gives the slices of stepping the whole latent."""
    torch.manual_seed(0)
    x, outs = torch.randn(1, 2, 6, 4), [torch.randn(1, 2, 6, 4) for _ in range(3)]
    whole_stepper, sliced_stepper = (DiffusersStepper(DPMSolverMultistepScheduler(), 3) for _ in range(2))
    whole, top, bottom = x, x[:, :, :4], x[:, :, 4:]
    for step in range(3):
        whole = whole_stepper.step("all", step, whole, outs[step])
        top = sliced_stepper.step("top", step, top, outs[step][:, :, :4])
        bottom = sliced_stepper.step("bottom", step, bottom, outs[step][:, :, 4:])
    # exact: the solver's update is elementwise, the same ops on the same numbers per slice
    torch.testing.assert_close(torch.cat([top, bottom], dim=2), whole, rtol=0, atol=0)
