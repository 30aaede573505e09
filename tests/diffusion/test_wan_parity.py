"""Wan 2.1 text-to-video (diffusers' WanTransformer3DModel, tiny, random) under every
parallel layout against the loop WanPipeline runs; the saved pipeline through generate and
the command line (an animated GIF), serially equal to WanPipeline's own frames."""

import pytest
import torch
from diffusers import UniPCMultistepScheduler
from parity import check_layouts, exact_two_rank_layouts, relative_error, stale_two_rank_layouts
from tiny_pipelines import build_pixart_pipeline
from tiny_wan import build_wan_pipeline, tiny_wan_transformer

from tessera import cli
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_denoise
from tessera.diffusion.stale_reference import stale_reference_denoise
from tessera.diffusion.stepper import DiffusersStepper
from tessera.runtime import spawn

# 3 latent frames of 8 x 6 latent pixels: 4 token rows a frame, 12 frame x row token rows of
# 3 tokens. Bands of 6 (2 ranks) and 3 (4 ranks) and 5 PipeFusion patches (3+3+2+2+2) cut
# frames in the middle.
STEPS, GUIDANCE, FRAMES, H, W = 3, 4.0, 3, 8, 6


def scheduler():
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "text": torch.randn(1, 7, 24, generator=g),
        "negative": torch.randn(1, 7, 24, generator=g),
        "noise": torch.randn(1, 4, FRAMES, H, W, generator=g),
    }


@torch.no_grad()
def pipeline_loop(model, data) -> torch.Tensor:
    """What WanPipeline.__call__ does between encoding and decoding (Wan 2.1: one
    transformer, the two branches as two calls), on the 5-D latent."""
    sched = scheduler()
    sched.set_timesteps(STEPS)
    sched.set_begin_index(0)
    latents = data["noise"]
    for t in sched.timesteps:
        timestep = t.expand(1)
        cond = model(latents, timestep, data["text"], return_dict=False)[0]
        uncond = model(latents, timestep, data["negative"], return_dict=False)[0]
        latents = sched.step(uncond + GUIDANCE * (cond - uncond), t, latents, return_dict=False)[0]
    return latents.reshape(1, 4, FRAMES * H, W)  # frame x row rows, as the samplers see it


def _denoise(layouts: dict[str, ParallelConfig], reference: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model, data = tiny_wan_transformer(), inputs()
    run = stale_reference_denoise if reference else parallel_denoise
    frames = torch.tensor([FRAMES])
    return {
        name: run(
            model,
            cond={"prompt_embeds": data["text"], "latent_frames": frames},
            uncond={"prompt_embeds": data["negative"], "latent_frames": frames},
            guidance_scale=GUIDANCE,
            stepper=DiffusersStepper(scheduler(), STEPS),
            noise=data["noise"].reshape(1, 4, FRAMES * H, W),
            config=config,
        )
        for name, config in layouts.items()
    }


def four_rank_layouts() -> dict:
    return {
        "usp2x2": ParallelConfig(ulysses=2, ring=2),
        "ring2_cfg2": ParallelConfig(ring=2, cfg_parallel=True),
        "pipefusion2_ulysses2": ParallelConfig(pipefusion=2, ulysses=2, patches=3, warmup_steps=STEPS),
        "pipefusion2_cfg2_patches5_warmup1": ParallelConfig(
            pipefusion=2, patches=5, warmup_steps=1, cfg_parallel=True
        ),
    }


def test_wan_layouts_match_the_pipeline_loop():
    torch.manual_seed(0)
    expected = pipeline_loop(tiny_wan_transformer(), inputs())
    single = {"serial": ParallelConfig(), "patches5": ParallelConfig(patches=5, warmup_steps=STEPS)}
    stale = stale_two_rank_layouts() | {
        "patches5_warmup0": ParallelConfig(patches=5, warmup_steps=0),
        "pipefusion2_cfg2_patches5_warmup1": four_rank_layouts()["pipefusion2_cfg2_patches5_warmup1"],
    }
    references = _denoise(stale, reference=True)
    ours = _denoise(single | {"patches5_warmup0": stale["patches5_warmup0"]})
    check_layouts(ours, expected, references)
    print(f"serial vs WanPipeline's loop: {relative_error(ours['serial'], expected):.1e}")
    for rank in spawn(_denoise, 2, exact_two_rank_layouts(STEPS) | stale_two_rank_layouts(), timeout_s=300):
        check_layouts(rank, expected, references)
    for rank in spawn(_denoise, 4, four_rank_layouts(), timeout_s=300):
        check_layouts(rank, expected, references)


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return build_wan_pipeline(tmp_path_factory.mktemp("wan"))


def test_generate_equals_the_pipeline_and_writes_a_gif(wan, tmp_path, capsys, monkeypatch):
    from PIL import Image

    from tessera.diffusion.pipelines import generate, load_pipeline

    pipe = load_pipeline(wan)
    pipe.set_progress_bar_config(disable=True)
    run = dict(height=32, width=16, num_frames=5)
    reference = pipe(
        "a red cat",
        num_inference_steps=2,
        guidance_scale=GUIDANCE,
        generator=torch.Generator().manual_seed(3),
        output_type="pt",
        **run,
    ).frames[0]
    ours = generate(
        pipe,
        prompt="a red cat",
        num_steps=2,
        guidance_scale=GUIDANCE,
        seed=3,
        config=ParallelConfig(),
        output_type="pt",
        **run,
    )
    # the same operations but the two branches batched: float32 rounding (measured 9e-7)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)

    out = tmp_path / "video.gif"
    base = ["generate", "--model", str(wan), "--prompt", "a red cat", "--steps", "2"]
    size = ["--height", "32", "--width", "16", "--frames", "5", "--out", str(out)]
    assert cli.main(base + size + ["--nproc", "2", "--ulysses", "2", "--parallel-vae"]) == 0
    assert "wrote a 5-frame 16x32 video (ulysses=2, 2 process(es))" in capsys.readouterr().out
    with Image.open(out) as gif:
        assert gif.n_frames == 5 and gif.size == (16, 32)

    # without --out a video goes to video.gif (what `tessera plan generate` prints runs as printed)
    monkeypatch.chdir(tmp_path)
    assert cli.main(base + ["--height", "32", "--width", "16", "--frames", "3"]) == 0
    assert (tmp_path / "video.gif").stat().st_size > 0
    capsys.readouterr()

    # refusals, one line each, before any rank starts
    bad = base + ["--height", "32", "--width", "16", "--out", str(out)]
    assert cli.main(bad + ["--frames", "4"]) == 2
    assert "--frames 4: this Wan VAE compresses time 2x, so it takes 2k+1 frames (e.g. 3 or 5)" in (
        capsys.readouterr().err
    )
    assert cli.main(bad[:-2] + ["--frames", "5", "--out", str(tmp_path / "video.png")]) == 2
    assert "must end in .gif" in capsys.readouterr().err
    # the VAE splits each frame's rows: 3 latent frames of 2 rows cannot go over 3 ranks
    from tessera.diffusion.pipelines import check_vae_split, meta_pipeline

    with pytest.raises(ValueError, match="a latent of 2 rows cannot be split over 3 ranks"):
        check_vae_split(meta_pipeline(wan), torch.zeros(1, 4, 3 * 2, 4), 3, num_frames=5)


def test_frames_on_an_image_pipeline_are_refused(tmp_path, capsys):
    pixart = build_pixart_pipeline(tmp_path / "pixart")
    args = [
        "generate",
        "--model",
        str(pixart),
        "--prompt",
        "a cat",
        "--frames",
        "5",
        "--out",
        str(tmp_path / "x.png"),
    ]
    assert cli.main(args) == 2
    assert (
        "--frames 5: PixArtAlphaPipeline makes images; frames are for video pipelines"
        in capsys.readouterr().err
    )
