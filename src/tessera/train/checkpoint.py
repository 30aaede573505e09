"""Checkpoints as a folder of safetensors + JSON, written atomically.

Layout of a checkpoint folder:

    config.json               {"format": "tessera-dit", "model": {...}, "recipe": {...}}
    model.safetensors         the weights to sample with (the EMA weights)
    train_state.safetensors   raw weights and optimizer tensors, for --resume
    train_state.json          step counter and optimizer hyper-parameters

The folder is first written beside its destination under a temporary name and then
renamed into place, so a crash mid-save leaves the previous checkpoint untouched and never
a half-written one that would load. Nothing is pickled: loading runs no code from the file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT = "tessera-dit"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or of another model."""


def save_checkpoint(
    directory: str | Path,
    *,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    train_tensors: dict[str, torch.Tensor] | None = None,
    train_meta: dict[str, Any] | None = None,
) -> Path:
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial", dir=directory.parent))
    try:
        (staging / "config.json").write_text(json.dumps({"format": FORMAT, **config}, indent=2))
        save_file(_contiguous(weights), staging / "model.safetensors")
        if train_tensors is not None:
            save_file(_contiguous(train_tensors), staging / "train_state.safetensors")
            (staging / "train_state.json").write_text(json.dumps(train_meta or {}, indent=2))
        _swap_into_place(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


def _swap_into_place(staging: Path, directory: Path) -> None:
    """Replace ``directory`` by ``staging``; at every instant one complete copy exists."""
    if not directory.exists():
        os.replace(staging, directory)
        return
    if not (directory / "config.json").exists() and any(directory.iterdir()):
        raise CheckpointError(f"refusing to overwrite {directory}: it is not empty and holds no checkpoint")
    retired = directory.with_name(f".{directory.name}.old")
    shutil.rmtree(retired, ignore_errors=True)
    os.replace(directory, retired)
    os.replace(staging, directory)
    shutil.rmtree(retired, ignore_errors=True)


def read_config(directory: str | Path, expected_format: str = FORMAT) -> dict[str, Any]:
    """A checkpoint folder's config.json, checked to be of ``expected_format``."""
    directory = Path(directory)
    path = directory / "config.json"
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint at {directory}: the folder does not exist")
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a Tessera checkpoint: config.json is missing")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is corrupt: {exc}") from None
    if not isinstance(config, dict) or config.get("format") != expected_format:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise CheckpointError(f"{path} has format {found!r}; expected {expected_format!r}")
    return config


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {exc}") from None


def load_weights_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Strict load with an error that names what does not match."""
    own = module.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    wrong = sorted(k for k in set(own) & set(tensors) if own[k].shape != tensors[k].shape)
    if missing or unexpected or wrong:
        details = []
        if missing:
            details.append(f"missing {missing[:5]}")
        if unexpected:
            details.append(f"unexpected {unexpected[:5]}")
        if wrong:
            k = wrong[0]
            details.append(f"shape of {k}: file {tuple(tensors[k].shape)}, model {tuple(own[k].shape)}")
        raise CheckpointError(f"{source} does not fit this model: " + "; ".join(details))
    module.load_state_dict(tensors)


def read_train_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "train_state.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no training state to resume from (train_state.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is corrupt: {exc}") from None


def load_dit(directory: str | Path):
    """The sampling weights of a Tessera DiT checkpoint, in eval mode."""
    from tessera.models.dit import DiT, DiTConfig

    directory = Path(directory)
    config = read_config(directory)
    try:
        model = DiT(DiTConfig.from_dict(config.get("model", {})))
    except TypeError as exc:
        raise CheckpointError(f"{directory / 'config.json'} has an invalid model config: {exc}") from None
    load_weights_into(model, load_tensors(directory / "model.safetensors"), directory / "model.safetensors")
    return model.eval()
