"""``BoostedOptimizer.state_dict()`` / ``load_state_dict()``: the optimizer state whole, in
the format the user's torch optimizer would give on one process.

``state_dict()`` returns ``{"state": {index: {key: tensor}}, "param_groups": [...]}`` with
parameters numbered as ``torch.optim.Optimizer.state_dict()`` numbers them (in the order of
the optimizer's groups as the user built them), each per-element state (Adam's
``exp_avg``, ...) whole and in the model class's own layout (ZeRO shards all-gathered over
``dp``, tensor parallel pieces over ``tp``, GPT-2's TP layout undone), and the groups'
current hyper-parameters (an LR scheduler's ``lr``). So it loads into a plain torch
optimizer on one process, and into a boosted one under any plan; ``boost`` loads the state a
user's optimizer held the same way. Every rank calls both (they communicate) and every rank
gets the whole state: like FSDP's full optimizer state dict, it needs the memory of one
unsharded copy.
"""

from __future__ import annotations

import torch

from tessera.memory.chunk_manager import local as _local
from tessera.train.checkpoint_boxes import tp_layout
from tessera.train.export import gpt2_tensor_layout

HYPER_SKIP = ("params", "param_names")


def _per_element(value, p: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == p.numel()


def _whole(name: str, p: torch.Tensor, piece: torch.Tensor, degree: int | None) -> torch.Tensor:
    """A state piece shaped like p's local tensor -> the whole tensor in the class's layout."""
    if hasattr(p, "placements"):
        from torch.distributed.tensor import DTensor

        piece = DTensor.from_local(
            piece.contiguous(), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        ).full_tensor()
    if degree is not None:
        piece = gpt2_tensor_layout(name, piece, degree, to_hf=True)
    return piece.detach().clone()


def _shard_states(engine) -> dict:
    """Stage 1-3: {param: {key: its piece of each state (p's local shape) or a scalar}}."""
    out: dict = {}
    for cg, shard in zip(engine.groups, engine.shards, strict=True):
        state = engine.optimizer.state.get(shard, {})
        flat = {}
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                full = torch.empty(cg.chunk.capacity, dtype=value.dtype, device=value.device)
                engine.gather_shards(cg, full, value)
                flat[key] = full
        for slot, p in zip(cg.chunk.slots, cg.params, strict=True):
            entry = {k: v for k, v in state.items() if k not in flat}
            for key, full in flat.items():
                entry[key] = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
            if state:
                out[p] = entry
    return out


def optimizer_state_dict(opt) -> dict:
    engine, model = opt.engine, opt.model
    degree = getattr(model, "_tessera_gpt2_tp_degree", None)
    params = dict(model.named_parameters())
    if engine.zero >= 1:
        per_param = _shard_states(engine)
    else:
        per_param = {
            p: {k: (_local(v) if _per_element(v, p) else v) for k, v in s.items()}
            for p, s in engine.optimizer.state.items()
        }
    state, groups, index = {}, [], 0
    for gi, names in enumerate(opt.group_names):
        ids = []
        for name in names:
            p = params[name]
            entry = {}
            for key in sorted(per_param.get(p, {})):
                value = per_param[p][key]
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    entry[key] = _whole(name, p, value, degree)
                else:
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            if entry:
                state[index] = entry
            ids.append(index)
            index += 1
        hyper = {k: v for k, v in engine.optimizer.param_groups[gi].items() if k not in HYPER_SKIP}
        groups.append({**hyper, "params": ids})
    out = {"state": state, "param_groups": groups}
    if opt.loss_scaler is not None:
        out["loss_scaler"] = opt.loss_scaler.state_dict()
    return out


def load_optimizer_state_dict(opt, state_dict: dict) -> None:
    engine, model, mesh = opt.engine, opt.model, opt.mesh
    saved_groups = state_dict["param_groups"]
    sizes = [len(names) for names in opt.group_names]
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if saved_sizes != sizes:
        raise ValueError(
            f"optimizer state has groups of {saved_sizes} parameters, but this optimizer's groups hold {sizes}"
        )
    for saved, group in zip(saved_groups, engine.optimizer.param_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k not in HYPER_SKIP})
    name_of = {}
    for saved, names in zip(saved_groups, opt.group_names, strict=True):
        name_of.update(zip((int(i) for i in saved["params"]), names, strict=True))
    engine.optimizer.state.clear()
    degree = getattr(model, "_tessera_gpt2_tp_degree", None)
    params = dict(model.named_parameters())
    for index in sorted(state_dict["state"], key=int):
        name = name_of[int(index)]
        p, entry = params[name], state_dict["state"][index]
        scalars = {k: v for k, v in entry.items() if v is not None and not _per_element(v, p)}
        odd = [k for k, v in scalars.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if odd and (engine.zero >= 1 or hasattr(p, "placements")):
            raise ValueError(
                f"optimizer state {odd[0]!r} of {name} has shape {tuple(scalars[odd[0]].shape)}, neither "
                f"the parameter's {tuple(p.shape)} nor a scalar: it cannot be sharded"
            )
        kinds = [k for k, v in entry.items() if _per_element(v, p)]
        if not kinds:  # scalars only (or nothing): keep them as the optimizer had them
            if engine.zero == 0 and scalars:
                engine.optimizer.state[p].update({k: _copy(v) for k, v in scalars.items()})
            continue
        for kind in kinds:
            full = entry[kind].reshape(_class_shape(name, p, degree))
            if degree is not None:
                full = gpt2_tensor_layout(name, full, degree, to_hf=False)
            dim, tp_rank, tp_size = tp_layout(p, mesh)
            piece = full if dim is None else full.chunk(tp_size, dim=dim)[tp_rank]
            engine.load_local(p, kind, piece.to(_local(p).device).contiguous(), scalars)
    if state_dict.get("loss_scaler") and opt.loss_scaler is not None:
        opt.loss_scaler.load_state_dict(state_dict["loss_scaler"])


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _class_shape(name: str, p: torch.Tensor, degree: int | None) -> torch.Size:
    """p's shape in the model class's own layout."""
    if degree is None:
        return p.shape
    return gpt2_tensor_layout(name, torch.empty(p.shape), degree, to_hf=True).shape
