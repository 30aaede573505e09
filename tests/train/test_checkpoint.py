import json
from pathlib import Path

import pytest
import torch

from tessera.models.dit import DiT, DiTConfig
from tessera.train import checkpoint as ckpt
from tessera.train import digits_dit as recipe_mod

TINY = recipe_mod.DigitsDiTRecipe(
    model=DiTConfig(image_size=8, patch_size=2, hidden_size=16, depth=1, num_heads=2),
    steps=3,
    batch_size=8,
    warmup_steps=1,
    checkpoint_every=3,
    log_every=1,
)


def _trained(tmp_path: Path) -> Path:
    from tessera.runtime import Mesh

    out = tmp_path / "ck"
    recipe_mod.train(TINY, Mesh(dp=1), out, progress=False)
    return out


def test_round_trip_restores_everything(tmp_path):
    out = _trained(tmp_path)
    model, ema, opt = recipe_mod.build(TINY)
    assert recipe_mod.restore(out, model, ema, opt) == 3
    saved = ckpt.load_tensors(out / "train_state.safetensors")
    for name, p in model.state_dict().items():
        assert torch.equal(p, saved[f"model.{name}"])
    assert int(opt.state_dict()["state"][0]["step"]) == 3
    config = ckpt.read_config(out)
    assert DiTConfig.from_dict(config["model"]) == TINY.model
    assert recipe_mod.DigitsDiTRecipe.from_dict(config["recipe"]) == TINY


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    out = _trained(tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(out, config={}, weights={"w": torch.ones(2)})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]  # no staging folder left


def test_refuses_to_overwrite_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ckpt.CheckpointError, match="not empty and holds no checkpoint"):
        ckpt.save_checkpoint(tmp_path, config={}, weights={"w": torch.ones(2)})
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_corrupt_and_foreign_checkpoints_are_named(tmp_path):
    out = _trained(tmp_path)
    (out / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors is corrupt"):
        ckpt.load_tensors(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ckpt.CheckpointError, match="has format 'other'"):
        ckpt.read_config(out)
    (out / "config.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="config.json is corrupt"):
        ckpt.read_config(out)


def test_weights_of_another_model_are_rejected(tmp_path):
    out = _trained(tmp_path)
    bigger = DiT(DiTConfig(image_size=8, patch_size=2, hidden_size=32, depth=1, num_heads=2))
    with pytest.raises(ckpt.CheckpointError, match=r"does not fit this model: shape of"):
        ckpt.load_weights_into(
            bigger, ckpt.load_tensors(out / "model.safetensors"), out / "model.safetensors"
        )


def test_resume_with_a_different_recipe_is_refused(tmp_path):
    from tessera.runtime import Mesh

    out = _trained(tmp_path)
    other = recipe_mod.DigitsDiTRecipe(**{**TINY.__dict__, "lr": 5e-4, "steps": 6})
    with pytest.raises(ValueError, match=r"differs in \['lr'\]"):
        recipe_mod.train(other, Mesh(dp=1), out, resume=True, progress=False)
