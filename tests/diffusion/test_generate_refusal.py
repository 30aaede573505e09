"""A refused generation layout leaves the caller's weights alone (issue #25).

``tessera generate`` checks the layout (patches against token rows, pipeline stages,
warm-up steps) in the parent, before any process starts: on the loaded Tessera DiT, or on
a saved diffusers pipeline built without weights (``meta_pipeline``). It used to start the
ranks, each loading the weights, and refuse there. ``tessera.diffusion.pipelines.generate``
checks the layout before PipeFusion frees the blocks a rank's stage never runs: a refused
call used to leave the caller's pipeline with those blocks on the meta device.
"""

import pytest
import torch
from tiny_pipelines import build_pixart_pipeline

from tessera import cli
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.pipelines import generate, load_pipeline
from tessera.models.dit import DiT, DiTConfig
from tessera.runtime import spawn
from tessera.train.checkpoint import save_checkpoint


def _dit_checkpoint(directory):
    torch.manual_seed(0)
    config = DiTConfig(image_size=8, patch_size=2, hidden_size=32, depth=2, num_heads=4)
    return save_checkpoint(directory, config={"model": config.to_dict()}, weights=DiT(config).state_dict())


@pytest.mark.parametrize(
    "flags, message",
    [
        # an 8 x 8 image in 2 x 2 patches has 4 token rows
        (["--pipefusion", "2", "--patches", "9"], "cannot split 4 token rows into 9 bands; use at most 4"),
        (["--pipefusion", "2", "--warmup-steps", "5"], "warmup_steps 5 exceeds the 2 sampling steps"),
    ],
)
def test_a_dit_layout_is_refused_before_any_rank_starts(tmp_path, capsys, flags, message):
    model = _dit_checkpoint(tmp_path / "ck")
    out = tmp_path / "grid.png"
    argv = ["generate", "--model", str(model), "--steps", "2", "--nproc", "2", *flags, "--out", str(out)]
    assert cli.main(argv) == cli.EXIT_USAGE  # a rank's refusal would exit 1 ("rank 0 failed")
    err = capsys.readouterr().err.strip()
    assert err == f"tessera: error: {message}" or (err.startswith("tessera: error: ") and message in err), err
    assert "\n" not in err and not out.exists()


def _pipeline_ranks(directory) -> dict:
    def run(pipe, config):
        return generate(
            pipe, prompt="a red cat", height=32, width=32, num_steps=2, guidance_scale=4.5, seed=1,
            config=config, output_type="pt",
        )  # fmt: skip

    pipe = load_pipeline(directory)
    before = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
    try:  # a 32 x 32 image is a 16 x 16 latent (VAE factor 2): 8 rows of 2 x 2 patches
        run(pipe, ParallelConfig(pipefusion=2, patches=9))
        message = None
    except ValueError as e:
        message = str(e)
    after = dict(pipe.transformer.named_parameters())
    whole = after.keys() == before.keys() and all(
        after[n].device.type == "cpu" and torch.equal(after[n].detach(), v) for n, v in before.items()
    )
    valid = ParallelConfig(pipefusion=2, patches=2, warmup_steps=2)
    image = run(pipe, valid)  # the same pipeline, as the refusal advises
    fresh = run(load_pipeline(directory), valid)
    same = image is None or torch.equal(image, fresh)  # rank 0 returns the image
    return {"message": message, "whole": whole, "same": same}


@pytest.fixture(scope="module")
def pixart(tmp_path_factory):
    return build_pixart_pipeline(tmp_path_factory.mktemp("pixart"))


def test_a_pipeline_layout_is_refused_before_any_rank_loads_its_weights(pixart, tmp_path, capsys):
    out = tmp_path / "image.png"
    argv = ["generate", "--model", str(pixart), "--prompt", "a red cat", "--steps", "2", "--height", "32"]
    argv += ["--width", "32", "--nproc", "2", "--pipefusion", "2", "--patches", "9", "--out", str(out)]
    assert cli.main(argv) == cli.EXIT_USAGE  # a rank's refusal would exit 1 ("rank 0 failed")
    err = capsys.readouterr().err.strip()
    assert err == "tessera: error: cannot split 8 token rows into 9 bands; use at most 8", err
    assert not out.exists()


def test_a_refused_pipefusion_layout_leaves_the_pipeline_whole(pixart):
    for rank in spawn(_pipeline_ranks, 2, pixart, timeout_s=300):
        assert rank["message"] == "cannot split 8 token rows into 9 bands; use at most 8"
        assert rank["whole"]  # every block still on the CPU with its weights
        assert rank["same"]  # exact: the same arithmetic on the same weights


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--digits", "07"], "--digits: "),
        (["--per-digit", "3"], "--per-digit: "),
        (["--digits", "07", "--per-digit", "3"], "--digits and --per-digit: "),
    ],
)
def test_class_flags_to_a_text_pipeline_are_refused_by_name(pixart, tmp_path, capsys, flags, message):
    """The reverse of a --prompt to a class-conditional checkpoint (tests/test_cli.py): a
    pipeline takes no classes, so --digits is named and refused, not ignored."""
    out = tmp_path / "image.png"
    argv = ["generate", "--model", str(pixart), "--prompt", "a red cat", *flags, "--out", str(out)]
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"tessera: error: {message}"), err
    assert "text-conditioned diffusers pipeline" in err and "--prompt" in err
    assert not out.exists()


def test_text_flags_to_a_class_conditional_checkpoint_are_refused_by_name(tmp_path, capsys):
    model = _dit_checkpoint(tmp_path / "ck")
    for flags, message in (
        (["--prompt", "a red cat"], "--prompt: "),
        (["--negative-prompt", "blurry"], "--negative-prompt: "),
        (["--height", "16", "--width", "16"], "--height and --width: "),
    ):
        assert cli.main(["generate", "--model", str(model), *flags]) == cli.EXIT_USAGE
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"tessera: error: {message}"), err
        assert "class-conditional Tessera DiT checkpoint" in err
        assert ("--digits" in err) == (message != "--height and --width: ")
