"""A saved diffusers PixArtAlphaPipeline through Tessera: same image as the pipeline's own
__call__ for the same seed, serially and spread over 2 ranks; and through the CLI."""

import json

import pytest
import torch
from tiny_pipelines import build_pixart_pipeline

from tessera import cli
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.pipelines import generate, load_pipeline
from tessera.runtime import spawn

PROMPT, SEED, STEPS, GUIDANCE, H, W = "a photo of a red cat", 3, 3, 4.5, 32, 24


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    return build_pixart_pipeline(tmp_path_factory.mktemp("pixart"))


def _ours(directory, config: ParallelConfig):
    from tessera.runtime.mesh import global_rank

    pipe = load_pipeline(directory, with_text_encoder=global_rank() == 0)
    return generate(
        pipe,
        prompt=PROMPT,
        height=H,
        width=W,
        num_steps=STEPS,
        guidance_scale=GUIDANCE,
        seed=SEED,
        config=config,
        output_type="pt",
    )


def _layouts(directory) -> dict:
    return {
        name: _ours(directory, config)
        for name, config in {
            "pipefusion2": ParallelConfig(pipefusion_degree=2, num_patches=2, warmup_steps=STEPS),
            "ulysses2": ParallelConfig(ulysses_degree=2),
            "cfg2": ParallelConfig(cfg_parallel=True),
        }.items()
    }


def test_same_image_as_the_pipeline_serially_and_on_two_ranks(pipeline_dir):
    pipe = load_pipeline(pipeline_dir)
    reference = pipe(
        PROMPT,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        height=H,
        width=W,
        generator=torch.Generator().manual_seed(SEED),
        output_type="pt",
        clean_caption=False,
        use_resolution_binning=False,
    ).images[0]
    torch.testing.assert_close(_ours(pipeline_dir, ParallelConfig()), reference, rtol=0, atol=0)
    ranks = spawn(_layouts, 2, pipeline_dir, timeout_s=300)
    assert all(v is None for v in ranks[1].values())  # the image is returned on rank 0
    for name, image in ranks[0].items():
        # Exact layouts: float32 rounding in split attention, through the VAE, well under
        # one 8-bit grey level (1/255 = 4e-3).
        torch.testing.assert_close(image, reference, rtol=0, atol=1e-4, msg=name)


def test_cli_generates_from_a_saved_pipeline(pipeline_dir, tmp_path, capsys):
    out = tmp_path / "image.png"
    args = [
        "generate",
        "--model",
        str(pipeline_dir),
        "--prompt",
        PROMPT,
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "32",
        "--out",
        str(out),
        "--nproc",
        "2",
        "--ring",
        "2",
    ]
    assert cli.main(args) == 0
    assert "wrote a 32x32 image (ring=2, 2 process(es))" in capsys.readouterr().out
    assert out.stat().st_size > 0
    assert cli.main(["generate", "--model", str(pipeline_dir), "--out", str(out)]) == 2
    assert "give a --prompt" in capsys.readouterr().err


def test_unsupported_pipeline_is_named(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableCascadePipeline"}))
    with pytest.raises(ValueError, match="pipeline StableCascadePipeline is not supported yet"):
        load_pipeline(tmp_path)
