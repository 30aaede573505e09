"""Sharded checkpoints of a boosted model and optimizer, loadable under another plan.

Every rank writes only what it owns: its tensor-parallel piece of each parameter (once per
data-parallel group; at ZeRO-3 its shard of each chunk) and its shard of the optimizer
states. Each piece is recorded with where it sits in the parameter: the tp rank and the
dimension the parameter is split along, and the range of the piece within that rank's
flattened local tensor. Loading under any plan rebuilds each parameter (and each of its
optimizer states) whole, one at a time, in the model class's own layout (HuggingFace's, for
GPT-2 whose TP plan changes the layout), then takes this rank's new piece. Values are copied,
never recomputed: a round trip is bit-exact.

Folder layout:

    config.json            format, model class and config, plan, optimizer, step counters,
                           group hyper-parameters, LR scheduler and loss-scaler state
    index-00000.json ...   per rank: the pieces in its shard file, its Python RNG state
    shard-00000.safetensors ...   per rank: the pieces, its torch RNG states

Loading checks that the pieces cover every element of every tensor before it reads any,
and names what is missing.

The folder is assembled under a temporary name and renamed into place after every rank has
written (a crash mid-save leaves the previous checkpoint). Nothing is pickled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from tessera.train.checkpoint import CheckpointError, _swap_into_place, read_config
from tessera.train.export import gpt2_tensor_layout
from tessera.train.train_state import restore_train_meta, rng_state, set_rng_state, train_meta

FORMAT = "tessera-sharded"


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def tp_layout(p: torch.Tensor, mesh) -> tuple[int | None, int, int]:
    """(shard dim or None, tp rank, tp size) of a parameter."""
    placements = getattr(p, "placements", ())
    dims = [pl.dim for pl in placements if pl.is_shard()]
    if not dims:
        return None, 0, 1
    return dims[0], mesh.rank("tp"), mesh.size("tp")


def _model_identity(model: nn.Module, optimizer=None) -> dict:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        config = {
            k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"
        }
    elif hasattr(config, "to_dict"):
        config = config.to_dict()
    else:
        config = None
    degree = getattr(model, "_tessera_gpt2_tp_degree", None)
    shapes = {}
    for name, p in model.named_parameters():  # a DTensor reports its global shape
        shape = p.shape
        if degree is not None:  # the model class's own layout, whatever the plan did
            shape = gpt2_tensor_layout(name, torch.empty(shape), degree, to_hf=True).shape
        shapes[name] = list(shape)
    shapes |= getattr(optimizer, "param_shapes", {})  # pipelined: other stages' are released here
    return {"class": type(model).__name__, "config": config, "shapes": shapes}


def _pieces(optimizer):
    """(param name, kind, local tensor of the piece, start, stop, local shape) this rank owns."""
    engine, mesh = optimizer.engine, optimizer.mesh
    names = {p: n for n, p in optimizer.model.named_parameters()}
    if hasattr(engine, "pieces"):  # a pipelined rank's stages (tessera.train.pipelined)
        return engine.pieces(names, mesh)
    dp_rank = mesh.rank("dp")
    out = []
    for i, cg in enumerate(engine.groups):
        for slot, p in zip(cg.chunk.slots, cg.params, strict=True):
            dim, tp_rank, _ = tp_layout(p, mesh)
            if dim is None and tp_rank != 0:
                continue  # replicated over tp: tp rank 0 writes it
            local_shape = list(slot.shape)
            numel = slot.numel
            if engine.zero >= 1:
                lo, hi = engine.shard_bounds(cg)
                a, b = max(lo, slot.offset), min(hi, slot.offset + numel)
                if a < b:
                    shard = engine.shards[i]
                    sources = {
                        k: v
                        for k, v in engine.optimizer.state.get(shard, {}).items()
                        if _per_element(v, shard)
                    }
                    if engine.zero == 3:
                        sources = {"param": shard.detach(), **sources}
                    for kind, flat in sources.items():
                        out.append(
                            (
                                names[p],
                                kind,
                                flat[a - lo : b - lo],
                                a - slot.offset,
                                b - slot.offset,
                                local_shape,
                            )
                        )
            if engine.zero < 3 and dp_rank == 0:
                local = p.to_local() if hasattr(p, "to_local") else p
                out.append((names[p], "param", local.detach().reshape(-1), 0, numel, local_shape))
            if engine.zero == 0 and dp_rank == 0:
                for kind, v in engine.optimizer.state.get(p, {}).items():
                    if _per_element(v, p):
                        local = v.to_local() if hasattr(v, "to_local") else v
                        out.append((names[p], kind, local.detach().reshape(-1), 0, numel, local_shape))
    return out


def _resident_pieces(optimizer):
    """``_pieces``, copied while offloaded chunks are in fast memory."""
    with optimizer.engine.resident():
        for name, kind, flat, *rest in _pieces(optimizer):
            yield (name, kind, flat.detach().contiguous().cpu().clone(), *rest)


def _per_element(value, like: torch.Tensor) -> bool:
    local = like.to_local() if hasattr(like, "to_local") else like
    return isinstance(value, torch.Tensor) and value.numel() == local.numel() and value.dim() > 0


def _scalars(optimizer) -> dict:
    """Non-per-element optimizer state (Adam's step), equal for every parameter."""
    state = optimizer.engine.optimizer.state
    for per_param in state.values():
        return {k: float(v) for k, v in per_param.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
    return {}


def save_sharded(
    model: nn.Module, optimizer, path: str | Path, *, scheduler=None, extra: dict | None = None
) -> Path:
    """Every rank calls this; see the module doc. ``scheduler`` (an LR scheduler) is saved
    with the groups' hyper-parameters, the fp16 loss scale and every rank's RNG states
    (``tessera.train.train_state``); ``extra`` (JSON) is kept in config.json."""
    rank, world = _rank_world()
    path = Path(path)
    staging = path.with_name(f".{path.name}.partial")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    mesh = optimizer.mesh
    params = dict(model.named_parameters())
    tensors, index = rng_state()
    tensors, pieces = dict(tensors), []
    for j, (name, kind, flat, start, stop, local_shape) in enumerate(_resident_pieces(optimizer)):
        dim, tp_rank, tp_size = tp_layout(params[name], mesh)
        key = f"{j}"
        tensors[key] = flat.detach().contiguous().cpu().clone()
        pieces.append(
            dict(
                key=key,
                name=name,
                kind=kind,
                start=start,
                stop=stop,
                local_shape=local_shape,
                shard_dim=dim,
                tp_rank=tp_rank,
                tp_size=tp_size,
            )
        )
    save_file(tensors, staging / f"shard-{rank:05d}.safetensors")
    (staging / f"index-{rank:05d}.json").write_text(json.dumps({"pieces": pieces, "rng": index}))
    train = train_meta(optimizer, scheduler)  # every rank: a JSON error is raised everywhere
    _barrier()
    if rank == 0:
        meta = {
            "format": FORMAT,
            "model": _model_identity(model, optimizer),
            "plan": optimizer.plan.to_dict(),
            "world": world,
            "gpt2_tp_degree": getattr(model, "_tessera_gpt2_tp_degree", None),
            "optimizer": type(optimizer.engine.optimizer).__name__,
            "scalars": _scalars(optimizer),
            "train": train,
            "extra": extra or {},
        }
        (staging / "config.json").write_text(json.dumps(meta, indent=2))
        _swap_into_place(staging, path)
    _barrier()
    return path


def _check_identity(path: Path, meta: dict, model: nn.Module, optimizer) -> None:
    mine = _model_identity(model, optimizer)
    if meta["model"]["class"] != mine["class"]:
        raise CheckpointError(f"{path} holds a {meta['model']['class']}, not a {mine['class']}")
    if meta["model"]["shapes"] != mine["shapes"]:
        theirs, ours = meta["model"]["shapes"], mine["shapes"]
        diff = sorted(set(theirs) ^ set(ours)) or [n for n in ours if theirs.get(n) != ours[n]]
        raise CheckpointError(f"{path} is from a different model: parameters differ at {diff[:5]}")
    if meta["optimizer"] != type(optimizer.engine.optimizer).__name__:
        raise CheckpointError(
            f"{path} holds {meta['optimizer']} state, but the optimizer is {type(optimizer.engine.optimizer).__name__}"
        )


def _read_indexes(path: Path, world: int) -> list[dict]:
    out = []
    for r in range(world):
        file = path / f"index-{r:05d}.json"
        if not file.is_file():
            raise CheckpointError(
                f"{path} is incomplete: {file.name} is missing (it was saved by {world} ranks)"
            )
        try:
            entry = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{file} is corrupt: {exc}") from None
        out.append(entry if isinstance(entry, dict) else {"pieces": entry, "rng": None})
    return out


def _open_shards(path: Path, world: int) -> dict:
    handles = {}
    for r in range(world):
        file = path / f"shard-{r:05d}.safetensors"
        if not file.is_file():
            raise CheckpointError(
                f"{path} is incomplete: {file.name} is missing (it was saved by {world} ranks)"
            )
        try:
            handles[r] = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file} is corrupt: {exc}") from None
    return handles


def _uncovered(entries: list) -> int:
    """Elements of one tensor that no piece holds (over every tp rank's local tensor)."""
    tp_size = entries[0][1]["tp_size"]
    by_tp: dict[int, list] = {}
    for _, e in entries:
        by_tp.setdefault(e["tp_rank"], []).append(e)
    missing = 0
    for t in range(tp_size):
        pieces = sorted(by_tp.get(t, []), key=lambda e: e["start"])
        numel = int(torch.Size(pieces[0]["local_shape"]).numel()) if pieces else None
        if numel is None:  # a whole tp piece is absent: count it by its neighbours' size
            numel = int(torch.Size(entries[0][1]["local_shape"]).numel())
        reached = 0
        for e in pieces:
            missing += max(0, e["start"] - reached)
            reached = max(reached, e["stop"])
        missing += max(0, numel - reached)
    return missing


def _check_coverage(path: Path, pieces: dict, model: nn.Module, optimizer) -> None:
    """Every element of every trained parameter (and of every optimizer state saved for it)
    is held by some piece; otherwise the error names what is missing."""
    problems = []
    for name, p in model.named_parameters():
        if p in optimizer.engine.owner and (name, "param") not in pieces:
            problems.append(f"{name} (no pieces)")
    for (name, kind), entries in sorted(pieces.items()):
        missing = _uncovered(entries)
        if missing:
            problems.append(f"{name} {kind} ({missing} elements)")
    if problems:
        raise CheckpointError(
            f"{path} does not cover every tensor: missing {', '.join(problems[:5])}"
            + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
        )


def load_sharded(model: nn.Module, optimizer, path: str | Path, *, scheduler=None) -> dict:
    """Load parameters and optimizer state saved under any plan into this boosted model and
    optimizer (every rank calls it), and the training state ``save_sharded`` kept (RNG
    states only at the world size they were saved at); returns the checkpoint's config."""
    path = Path(path)
    meta = read_config(path, FORMAT)
    _check_identity(path, meta, model, optimizer)
    indexes = _read_indexes(path, meta["world"])
    pieces: dict[tuple[str, str], list] = {}
    for r, index in enumerate(indexes):
        for e in index["pieces"]:
            pieces.setdefault((e["name"], e["kind"]), []).append((r, e))
    _check_coverage(path, pieces, model, optimizer)
    handles = _open_shards(path, meta["world"])
    saved_degree, new_degree = meta["gpt2_tp_degree"], getattr(model, "_tessera_gpt2_tp_degree", None)
    engine, mesh = optimizer.engine, optimizer.mesh
    kinds = sorted({kind for _, kind in pieces})
    with engine.resident():  # offloaded chunks are in fast memory while loading
        for name, p in model.named_parameters():
            for kind in kinds:
                if (name, kind) not in pieces:
                    continue
                full = _assemble(pieces[(name, kind)], handles)
                if saved_degree is not None:
                    full = gpt2_tensor_layout(name, full, saved_degree, to_hf=True)
                if new_degree is not None:
                    full = gpt2_tensor_layout(name, full, new_degree, to_hf=False)
                dim, tp_rank, tp_size = tp_layout(p, mesh)
                local = full if dim is None else full.chunk(tp_size, dim=dim)[tp_rank]
                engine.load_local(p, kind, local.to(_device(p)).contiguous(), meta["scalars"])
    restore_train_meta(meta.get("train", {}), optimizer, scheduler)
    rank, world = _rank_world()
    meta["rng_restored"] = world == meta["world"] and indexes[rank].get("rng") is not None
    if meta["rng_restored"]:
        rng = {k: handles[rank].get_tensor(k) for k in handles[rank].keys() if k.startswith("rng.")}
        set_rng_state(rng, indexes[rank]["rng"])
    return meta


def _device(p: torch.Tensor) -> torch.device:
    return (p.to_local() if hasattr(p, "to_local") else p).device


def _assemble(entries: list, handles: dict) -> torch.Tensor:
    flats: dict[int, torch.Tensor] = {}
    shapes: dict[int, list] = {}
    for r, e in entries:
        shapes[e["tp_rank"]] = e["local_shape"]
        flat = flats.setdefault(e["tp_rank"], torch.empty(int(torch.Size(e["local_shape"]).numel())))
        flat[e["start"] : e["stop"]] = handles[r].get_tensor(e["key"])
    locals_ = [flats[t].view(shapes[t]) for t in sorted(flats)]
    shard_dim = entries[0][1]["shard_dim"]
    if shard_dim is None:
        return locals_[0]
    return torch.cat(locals_, dim=shard_dim)
