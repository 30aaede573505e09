"""LTX-Video (diffusers' LTXVideoTransformer3DModel, tiny, random) under every parallel
layout against the loop LTXPipeline runs on its packed tokens; the saved pipeline through
generate (equal to LTXPipeline's own frames) and the command line (an animated GIF)."""

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline
from parity import check_layouts, exact_two_rank_layouts, relative_error, stale_two_rank_layouts
from tiny_ltx import build_ltx_pipeline, tiny_ltx_transformer

from tessera import cli
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_denoise
from tessera.diffusion.stale_reference import stale_reference_denoise
from tessera.diffusion.stepper import DiffusersStepper
from tessera.runtime import spawn

# 3 latent frames of 4 x 5 latent pixels, one token each: 12 frame x row token rows of 5;
# bands of 6 (2 ranks) and 3 (4 ranks) and 5 PipeFusion patches cut frames.
STEPS, GUIDANCE, FRAMES, H, W, MU = 3, 3.0, 3, 4, 5, 0.6
SCALE = (2 / 25, 4.0, 4.0)  # rope_interpolation_scale: temporal compression / frame rate, spatial


def scheduler_and_kwargs():
    sigmas = np.linspace(1.0, 1 / STEPS, STEPS)
    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), {"sigmas": sigmas, "mu": MU}


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(1, 7)
    mask[:, 5:] = 0  # two padded prompt tokens
    return {
        "text": torch.randn(1, 7, 24, generator=g),
        "negative": torch.randn(1, 7, 24, generator=g),
        "mask": mask,
        "noise": torch.randn(1, 8, FRAMES, H, W, generator=g),
    }


@torch.no_grad()
def pipeline_loop(model, data) -> torch.Tensor:
    """What LTXPipeline.__call__ does between encoding and decoding: packed tokens, the two
    branches batched [negative, prompt]."""
    scheduler, kwargs = scheduler_and_kwargs()
    scheduler.set_timesteps(**kwargs)
    latents = LTXPipeline._pack_latents(data["noise"], 1, 1)
    text = torch.cat([data["negative"], data["text"]])
    mask = torch.cat([data["mask"], data["mask"]])
    for t in scheduler.timesteps:
        out = model(
            torch.cat([latents] * 2),
            text,
            t.expand(2),
            mask,
            num_frames=FRAMES,
            height=H,
            width=W,
            rope_interpolation_scale=SCALE,
            return_dict=False,
        )[0].float()
        uncond, cond = out.chunk(2)
        latents = scheduler.step(uncond + GUIDANCE * (cond - uncond), t, latents, return_dict=False)[0]
    video = LTXPipeline._unpack_latents(latents, FRAMES, H, W, 1, 1)
    return video.reshape(1, 8, FRAMES * H, W)  # frame x row rows, as the samplers see it


def _denoise(layouts: dict[str, ParallelConfig], reference: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model, data = tiny_ltx_transformer(), inputs()
    run = stale_reference_denoise if reference else parallel_denoise
    shared = {"latent_frames": torch.tensor([FRAMES]), "rope_interpolation_scale": torch.tensor([SCALE])}
    out = {}
    for name, config in layouts.items():
        scheduler, kwargs = scheduler_and_kwargs()
        out[name] = run(
            model,
            cond={"prompt_embeds": data["text"], "prompt_attention_mask": data["mask"]} | shared,
            uncond={"prompt_embeds": data["negative"], "prompt_attention_mask": data["mask"]} | shared,
            guidance_scale=GUIDANCE,
            stepper=DiffusersStepper(scheduler, STEPS, **kwargs),
            noise=data["noise"].reshape(1, 8, FRAMES * H, W),
            config=config,
        )
    return out


def four_rank_layouts() -> dict:
    return {
        "usp2x2": ParallelConfig(ulysses=2, ring=2),
        "pipefusion2_cfg2_patches5_warmup1": ParallelConfig(
            pipefusion=2, patches=5, warmup_steps=1, cfg_parallel=True
        ),
    }


def test_ltx_layouts_match_the_pipeline_loop():
    torch.manual_seed(0)
    expected = pipeline_loop(tiny_ltx_transformer(), inputs())
    single = {"serial": ParallelConfig(), "patches5": ParallelConfig(patches=5, warmup_steps=STEPS)}
    stale = stale_two_rank_layouts() | {
        "pipefusion2_cfg2_patches5_warmup1": four_rank_layouts()["pipefusion2_cfg2_patches5_warmup1"]
    }
    references = _denoise(stale, reference=True)
    ours = _denoise(single)
    check_layouts(ours, expected, references)
    print(f"serial vs LTXPipeline's loop: {relative_error(ours['serial'], expected):.1e}")
    for rank in spawn(_denoise, 2, exact_two_rank_layouts(STEPS) | stale_two_rank_layouts(), timeout_s=300):
        check_layouts(rank, expected, references)
    for rank in spawn(_denoise, 4, four_rank_layouts(), timeout_s=300):
        check_layouts(rank, expected, references)


@pytest.fixture(scope="module")
def ltx(tmp_path_factory):
    return build_ltx_pipeline(tmp_path_factory.mktemp("ltx"))


def test_generate_equals_the_pipeline_and_writes_a_gif(ltx, tmp_path, capsys):
    from PIL import Image

    from tessera.diffusion.pipelines import generate, load_pipeline

    pipe = load_pipeline(ltx)
    pipe.set_progress_bar_config(disable=True)
    run = dict(height=32, width=64, num_frames=5, guidance_scale=GUIDANCE)
    reference = pipe(
        "a red cat",
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(3),
        output_type="pt",
        **run,
    ).frames[0]
    ours = generate(
        pipe, prompt="a red cat", num_steps=2, seed=3, config=ParallelConfig(), output_type="pt", **run
    )
    # the same operations, the two branches batched in the other order: float32 rounding (measured 8e-7)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)

    out = tmp_path / "video.gif"
    base = ["generate", "--model", str(ltx), "--prompt", "a red cat", "--steps", "2", "--out", str(out)]
    base += ["--height", "32", "--width", "64"]
    assert cli.main(base + ["--frames", "5", "--nproc", "2", "--ring", "2", "--parallel-vae"]) == 0
    assert "wrote a 5-frame 64x32 video (ring=2, 2 process(es))" in capsys.readouterr().out
    with Image.open(out) as gif:
        assert gif.n_frames == 5
    assert cli.main(base + ["--frames", "6"]) == 2
    assert "--frames 6: this LTX VAE compresses time 2x, so it takes 2k+1 frames (e.g. 5 or 7)" in (
        capsys.readouterr().err
    )
