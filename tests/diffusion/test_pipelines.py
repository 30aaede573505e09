"""Saved diffusers pipelines (PixArt-alpha, SD3, Flux-dev; tiny, random) through Tessera:
the same image as the pipeline's own __call__ for the same seed, serially and spread over
2 ranks; and through the CLI."""

import json

import pytest
import torch
from tiny_pipelines import build_flux_pipeline, build_pixart_pipeline, build_sd3_pipeline

from tessera import cli
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.pipeline_families import FAMILIES as FAMILY_ADAPTERS
from tessera.diffusion.pipelines import generate, load_pipeline
from tessera.runtime import spawn

PROMPT, SEED, STEPS, GUIDANCE, H, W = "a photo of a red cat", 3, 3, 4.5, 32, 24
FAMILIES = {
    "pixart": (build_pixart_pipeline, {"clean_caption": False, "use_resolution_binning": False}),
    "sd3": (build_sd3_pipeline, {}),
    "flux": (build_flux_pipeline, {}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    build, call_kwargs = FAMILIES[request.param]
    return request.param, build(tmp_path_factory.mktemp(request.param)), call_kwargs


def resident_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.device.type != "meta")


def _ours(directory, config: ParallelConfig, resident: dict | None = None):
    from tessera.runtime.mesh import global_rank

    pipe = load_pipeline(directory, with_text_encoder=global_rank() == 0)
    image = generate(
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
    if resident is not None:
        resident[config.describe()] = resident_bytes(pipe.transformer)
    return image


def _layouts(directory, names: list[str]) -> dict:
    layouts = {
        "pipefusion2": ParallelConfig(pipefusion=2, patches=2, warmup_steps=STEPS),
        "ulysses2": ParallelConfig(ulysses=2),
        "cfg2": ParallelConfig(cfg_parallel=True),
    }
    resident: dict[str, int] = {}
    images = {name: _ours(directory, layouts[name], resident) for name in names}
    return {"images": images, "resident": resident}


def test_same_image_as_the_pipeline_serially_and_on_two_ranks(family):
    name, directory, call_kwargs = family
    pipe = load_pipeline(directory)
    reference = pipe(
        PROMPT,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        height=H,
        width=W,
        generator=torch.Generator().manual_seed(SEED),
        output_type="pt",
        **call_kwargs,
    ).images[0]
    # Serial: the pipeline's own operations (Flux: the adapter's RoPE tables and time
    # scaling round differently by ~1 ulp, measured 3e-7).
    torch.testing.assert_close(_ours(directory, ParallelConfig()), reference, rtol=0, atol=1e-6)
    layouts = ["pipefusion2", "ulysses2"] + (["cfg2"] if name != "flux" else [])  # Flux-dev: no CFG branch
    ranks = spawn(_layouts, 2, directory, layouts, timeout_s=300)
    assert all(v is None for v in ranks[1]["images"].values())  # the image is returned on rank 0
    # PipeFusion: each rank keeps only its stage's blocks (and the shared embeddings and
    # head), so the two ranks' blocks add up to the model's once; other layouts keep all.
    full, blocks = resident_bytes(pipe.transformer), _block_bytes(pipe.transformer)
    pipefusion = ParallelConfig(pipefusion=2, patches=2, warmup_steps=STEPS).describe()
    held = [rank["resident"][pipefusion] for rank in ranks]
    assert max(held) < full and sum(held) == 2 * (full - blocks) + blocks
    assert ranks[0]["resident"]["ulysses=2"] == full
    for layout, image in ranks[0]["images"].items():
        # Exact layouts: float32 rounding in split attention, through the VAE, well under
        # one 8-bit grey level (1/255 = 4e-3).
        torch.testing.assert_close(image, reference, rtol=0, atol=1e-4, msg=f"{name} {layout}")


def _block_bytes(transformer: torch.nn.Module) -> int:
    from tessera.diffusion.adapters import adapter_for

    return sum(resident_bytes(block) for block in adapter_for(transformer).blocks)


def test_cli_generates_from_a_saved_pipeline(family, tmp_path, capsys):
    name, directory, _ = family
    out = tmp_path / "image.png"
    args = [
        "generate",
        "--model",
        str(directory),
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
    assert cli.main(["generate", "--model", str(directory), "--out", str(out)]) == 2
    assert "give a --prompt" in capsys.readouterr().err


def test_unsupported_pipeline_is_named(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableCascadePipeline"}))
    with pytest.raises(ValueError, match="pipeline StableCascadePipeline is not supported yet"):
        load_pipeline(tmp_path)


@pytest.mark.parametrize("pipeline_family", FAMILY_ADAPTERS, ids=lambda f: type(f).__name__)
def test_prompts_are_encoded_where_the_pipeline_executes(pipeline_family):
    """Each family asks the pipeline's ``encode_prompt`` for its execution device (its text
    encoders' device), as the pipeline's own ``__call__`` does: PixArt and SD3 move the token
    ids to the device they are given, so the CPU given while the encoders sat on a GPU failed
    there (found by benchmarks/gpu/cuda_check.py). ``meta`` stands in for a second device."""
    seen = []
    outputs = {"FluxFamily": 3, "WanFamily": 2}.get(type(pipeline_family).__name__, 4)  # encode_prompt's tuple

    class Pipe:
        _execution_device = torch.device("meta")

        def encode_prompt(self, *args, device=None, **kwargs):
            seen.append(device)
            return (torch.zeros(1, 2),) * outputs

    pipeline_family.encode(Pipe(), "a red cat", "", cfg=True)
    assert seen == [torch.device("meta")]
