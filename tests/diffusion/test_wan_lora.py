"""LoRA (#31 item 5): a random LoRA saved by peft/diffusers, loaded into the saved Wan
pipeline with load_lora_weights, fused or not, under every method on 2 ranks: the frames
equal the LoRA pipeline's own __call__ run serially; a LoRA for modules the model lacks
and a pipeline without LoRA support are refused by name."""

import pytest
import torch
from tiny_wan import build_wan_pipeline, tiny_wan_transformer

from tessera import cli
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.lora import check_lora, load_lora
from tessera.diffusion.pipelines import generate, load_pipeline
from tessera.runtime import spawn

RUN = dict(height=32, width=16, num_frames=5, guidance_scale=4.0)
STEPS, SEED = 2, 3


def save_random_lora(directory, *, rename=None):
    """A rank-4 LoRA on every attention projection with random (not zero) B matrices,
    saved as diffusers saves one (pytorch_lora_weights.safetensors)."""
    from diffusers import WanPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(7)
    model = tiny_wan_transformer()
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights=False))
    state = get_peft_model_state_dict(model)
    if rename:
        state = {k.replace(*rename): v for k, v in state.items()}
    WanPipeline.save_lora_weights(directory, transformer_lora_layers=state)
    return directory


def _ours(pipe, config):
    return generate(
        pipe, prompt="a red cat", num_steps=STEPS, seed=SEED, config=config, output_type="pt", **RUN
    )


def _ranks(pipeline_dir, lora_dir):
    from tessera.runtime.mesh import global_rank

    layouts = {
        "ulysses2": ParallelConfig(ulysses=2),
        "ring2": ParallelConfig(ring=2),
        "cfg2": ParallelConfig(cfg_parallel=True),
        "distrifusion2": ParallelConfig(distrifusion=2, warmup_steps=STEPS),
        "tp2": ParallelConfig(tp=2),  # the LoRA merged into the split Linears, the wrappers back after
        "pipefusion2": ParallelConfig(pipefusion=2, patches=3, warmup_steps=STEPS),  # last: frees blocks
    }
    out = {}
    for fuse in (False, True):
        pipe = load_pipeline(pipeline_dir, with_text_encoder=global_rank() == 0)
        pipe.set_progress_bar_config(disable=True)
        load_lora(pipe, lora_dir, fuse=fuse)
        for name, config in layouts.items():
            out[f"{name}{'_fused' if fuse else ''}"] = _ours(pipe, config)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_lora")
    return build_wan_pipeline(root / "wan"), save_random_lora(root / "lora")


def test_lora_under_every_method_equals_the_lora_pipeline(folders):
    wan, lora = folders
    pipe = load_pipeline(wan)
    pipe.set_progress_bar_config(disable=True)
    base = _ours(pipe, ParallelConfig())
    pipe.load_lora_weights(str(lora))

    def reference():
        return pipe(
            "a red cat",
            num_inference_steps=STEPS,
            generator=torch.Generator().manual_seed(SEED),
            output_type="pt",
            **RUN,
        ).frames[0]

    unfused = reference()
    assert (unfused - base).abs().max() > 1e-2  # the LoRA changes the video
    results = {"serial": _ours(pipe, ParallelConfig())} | spawn(_ranks, 2, wan, lora, timeout_s=300)[0]
    pipe.fuse_lora()
    fused = reference()
    worst = {
        name: (frames - (fused if "fused" in name else unfused)).abs().max().item()
        for name, frames in results.items()
    }
    print(f"LoRA frames vs the LoRA pipeline, worst |difference|: {max(worst.values()):.1e}")
    for name, frames in results.items():
        # float32 rounding: split attention and batched CFG branches against the pipeline's
        # own loop, and a fused LoRA (W + BA rounded once) against the unfused reference;
        # frames in [0, 1]: far below an 8-bit level (4e-3)
        torch.testing.assert_close(frames, fused if "fused" in name else unfused, rtol=0, atol=1e-4, msg=name)


def test_a_lora_for_missing_modules_is_refused(folders, tmp_path, capsys):
    wan, _ = folders
    bad = save_random_lora(tmp_path / "bad", rename=("blocks.2.", "blocks.9."))
    pipe = load_pipeline(wan)
    with pytest.raises(ValueError, match=r"targets transformer\.blocks\.9\.attn1\.to_., which this"):
        check_lora(pipe, bad)
    args = ["generate", "--model", str(wan), "--prompt", "a cat", "--frames", "5"]
    args += ["--height", "32", "--width", "16", "--out", str(tmp_path / "v.gif")]
    assert cli.main(args + ["--lora", str(bad)]) == 2
    assert "WanTransformer3DModel does not have" in capsys.readouterr().err
    assert cli.main(args + ["--fuse-lora"]) == 2
    assert "give the LoRA with --lora DIR" in capsys.readouterr().err


def test_a_pipeline_without_lora_support_is_refused(tmp_path):
    from tiny_pipelines import build_pixart_pipeline

    pixart = load_pipeline(build_pixart_pipeline(tmp_path / "pixart"))
    with pytest.raises(ValueError, match="PixArtAlphaPipeline does not load LoRA weights"):
        check_lora(pixart, tmp_path)
