"""What a checkpoint keeps beside weights and optimizer tensors so that a resumed run takes
the same next step: the optimizer groups' hyper-parameters (the learning rate an LR
scheduler set), the scheduler's own state, the fp16 loss scaler, and each rank's random
number generators (dropout draws from them).

Hyper-parameters and scheduler state go to JSON; the RNG states are tensors (torch's) and
JSON (Python's ``random``) saved per rank. RNG states are restored only when the world size
is the one they were saved at: a rank of another plan has no state of its own to take.
"""

from __future__ import annotations

import random

import torch


def _jsonable(value, where: str):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple | list):
        return [_jsonable(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, where) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"{where} holds a {type(value).__name__}, which a checkpoint cannot store as JSON")


def train_meta(optimizer, scheduler=None) -> dict:
    """JSON: the groups' hyper-parameters, the scheduler's state, the loss scaler's."""
    groups = [
        {
            k: _jsonable(v, f"optimizer group setting {k!r}")
            for k, v in g.items()
            if k not in ("params", "param_names")
        }
        for g in optimizer.inner.param_groups
    ]
    meta = {"param_groups": groups}
    if scheduler is not None:
        meta["scheduler"] = _jsonable(scheduler.state_dict(), f"{type(scheduler).__name__}.state_dict()")
    if optimizer.loss_scaler is not None:
        meta["loss_scaler"] = optimizer.loss_scaler.state_dict()
    return meta


def restore_train_meta(meta: dict, optimizer, scheduler=None) -> None:
    groups = meta.get("param_groups")
    if groups is not None:
        if len(groups) != len(optimizer.inner.param_groups):
            raise ValueError(
                f"checkpoint has {len(groups)} optimizer groups, this optimizer {len(optimizer.inner.param_groups)}"
            )
        for saved, group in zip(groups, optimizer.inner.param_groups, strict=True):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    if scheduler is not None:
        if "scheduler" not in meta:
            raise ValueError("the checkpoint holds no LR scheduler state (it was saved without scheduler=)")
        scheduler.load_state_dict(meta["scheduler"])
    if meta.get("loss_scaler") and optimizer.loss_scaler is not None:
        optimizer.loss_scaler.load_state_dict(meta["loss_scaler"])


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, JSON) of this process's RNGs: torch's CPU and current CUDA generator, Python's."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    version, state, gauss = random.getstate()
    return tensors, {"python": [version, list(state), gauss]}


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))
