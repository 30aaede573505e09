"""`tessera plan generate` on a saved video pipeline (tiny Wan 2.1): the planner costs the
video DiT on its latent frames x token rows x token columns with the image DiT's cost model,
so the estimate is non-zero and grows with the frames; the parameter count is the model's;
frame counts the VAE's temporal compression cannot take are refused as tessera generate
refuses them; only the layouts the run takes are ranked, and the printed command carries
--frames."""

import re
import shlex
import sys
from pathlib import Path

import pytest

from tessera.cli import build_parser, main
from tessera.cli_generate import build_layout
from tessera.diffusion.adapters import adapter_for
from tessera.diffusion.parallel import check_layout
from tessera.plan.commands import _hardware, add_hardware_args
from tessera.plan.search import generate_configs, search_generate
from tessera.plan.video import video_plan

sys.path.insert(0, str(Path(__file__).parents[1] / "diffusion"))

H, W = 32, 16  # pixels: the tiny Wan VAE is 4x spatially, its patches 2x2 -> 4 x 2 tokens a frame


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from tiny_wan import build_wan_pipeline

    return build_wan_pipeline(tmp_path_factory.mktemp("plan-video") / "wan")


def _hw(devices: int):
    import argparse

    p = argparse.ArgumentParser()
    add_hardware_args(p)
    return _hardware(p.parse_args(["--model", "x", "--devices", str(devices)]))


def test_the_estimate_is_the_videos_tokens_and_grows_with_frames(wan):
    import json

    from diffusers import WanTransformer3DModel

    vae = json.loads((wan / "vae" / "config.json").read_text())
    k, s = vae["scale_factor_temporal"], vae["scale_factor_spatial"]
    model = WanTransformer3DModel.from_pretrained(wan / "transformer")
    adapter = adapter_for(model)
    hw = _hw(2)
    seconds, activations, decode = {}, {}, []
    for frames in (1, 5, 9, 17):
        plan = video_plan(wan, frames=frames, height=H, width=W)
        decode.append(plan.spec.decode_flops)
        latent = (frames - 1) // k + 1
        assert plan.shape.latent_frames == latent
        assert plan.spec.tokens == latent * (H // s // 2) * (W // s // 2)  # 2x2 patches
        assert plan.spec.total_params == sum(p.numel() for p in model.parameters())
        assert (plan.spec.layers, plan.spec.hidden, plan.spec.heads, plan.spec.ffn) == (3, 24, 2, 32)
        ranked = search_generate(plan.spec, 2, hw, steps=3, runnable=plan.runnable)
        assert ranked.fits and not ranked.dropped
        by_layout = {p.config.describe(): p for p in ranked.fits}
        # exactly the layouts tessera generate takes on this model and shape are ranked
        for config in generate_configs(plan.spec, 2, True):
            try:
                check_layout(adapter, config, plan.shape.rows * 2, plan.shape.cols * 2)
                takes = True
            except ValueError:
                takes = False
            assert (config.describe() in by_layout) == takes, config.describe()
        seconds[frames] = {name: p.seconds for name, p in by_layout.items()}
        activations[frames] = {name: p.activation_bytes_per_rank for name, p in by_layout.items()}
    for name in seconds[1]:
        series = [seconds[f][name] for f in (1, 5, 9, 17)]
        assert series[0] > 0 and series == sorted(series) and series[0] < series[-1], (name, series)
        # activations are per token: 1, 3, 5 and 9 latent frames
        a = [activations[f][name] for f in (1, 5, 9, 17)]
        assert [x / a[0] for x in a] == pytest.approx([1, 3, 5, 9], rel=1e-12), name  # exact ratios of ints
    # the VAE decodes every frame: its FLOPs grow with them (and are in each estimate, on one rank)
    assert 0 < decode[0] < decode[1] < decode[2] < decode[3], decode


def _choice(capsys, argv):
    assert main(["plan", "generate", *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    words = shlex.split(next(line for line in out if line.startswith("choice: ")).removeprefix("choice: "))
    best = next(re.split(r"\s{2,}", line.strip())[1] for line in out if re.match(r"1\s{2,}", line))
    return out, words[1:], best


def test_the_printed_command_carries_the_frames(wan, capsys):
    size = ["--height", "32", "--width", "16", "--frames", "9"]
    out, words, best = _choice(capsys, ["--model", str(wan), "--devices", "2", "--steps", "3", *size])
    assert out[0].startswith("WanTransformer3DModel: 9 frames (5 latent) of 32x16 px: 5 x 4 x 2 = 40 tokens")
    args = build_parser().parse_args(words)
    assert (args.model, args.frames, args.height, args.width, args.steps) == (str(wan), 9, 32, 16, 3)
    assert build_layout(args).describe() == best and args.nproc == 2

    # no size or frames: the pipeline's own defaults (WanPipeline: 81 frames of 480x832)
    out, words, _ = _choice(capsys, ["--model", str(wan), "--devices", "1", "--steps", "2"])
    args = build_parser().parse_args(words)
    assert (args.frames, args.height, args.width) == (81, 480, 832)
    assert "81 frames (41 latent) of 480x832 px: 41 x 60 x 104 = 255840 tokens" in out[0]


def test_frames_the_vae_cannot_take_are_refused(wan, capsys):
    base = ["plan", "generate", "--model", str(wan), "--devices", "2", "--height", "32", "--width", "16"]
    for frames, nearest in (("4", "(e.g. 3 or 5)"), ("8", "(e.g. 7 or 9)"), ("0", "(e.g. 1 or 3)")):
        assert main([*base, "--frames", frames]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        refusal = f"--frames {frames}: this Wan VAE compresses time 2x, so it takes 2k+1 frames {nearest}"
        assert refusal in err[0]
    # frames are for video pipelines
    assert main(["plan", "generate", "--model", "flux-dev", "--devices", "2", "--frames", "9"]) == 2
    assert "--frames 9: flux-dev is not a video pipeline folder" in capsys.readouterr().err


def test_a_folder_of_configs_alone_is_planned(wan, tmp_path, capsys):
    # the planner reads configs, never weights: the saved pipeline less every weights file
    # (WanPipeline's transformer is an optional component, which DiffusionPipeline's own
    # from_pretrained would load from disk in place of the weightless one)
    import shutil

    from tessera.diffusion.pipelines import meta_pipeline

    configs = tmp_path / "wan-configs"
    shutil.copytree(wan, configs, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    assert not list(configs.rglob("*.safetensors"))
    pipe = meta_pipeline(configs)
    assert pipe.transformer.device.type == "meta" and pipe.vae.device.type == "meta"
    out, words, _ = _choice(
        capsys, ["--model", str(configs), "--devices", "2", "--steps", "2", "--frames", "5"]
    )
    assert "5 frames (3 latent)" in out[0] and words[words.index("--frames") + 1] == "5"
