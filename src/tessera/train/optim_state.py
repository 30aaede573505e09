"""Optimizer state as flat named tensors (for safetensors) plus JSON-able hyper-parameters."""

from __future__ import annotations

from typing import Any

import torch

PREFIX = "optim."


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            if not torch.is_tensor(value):
                raise TypeError(f"optimizer state {key!r} of param {index} is not a tensor")
            tensors[f"{PREFIX}{index}.{key}"] = value
    meta = {"param_groups": state["param_groups"]}
    return tensors, meta


def optimizer_from_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if not name.startswith(PREFIX):
            continue
        index, key = name[len(PREFIX) :].split(".", 1)
        per_param.setdefault(int(index), {})[key] = value
    expected = sum(len(g["params"]) for g in optimizer.param_groups)
    saved = sum(len(g["params"]) for g in meta["param_groups"])
    if saved != expected:
        raise ValueError(f"optimizer state holds {saved} parameters but the model has {expected}")
    optimizer.load_state_dict({"state": per_param, "param_groups": meta["param_groups"]})
