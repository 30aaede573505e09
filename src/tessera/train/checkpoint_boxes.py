"""What a rank owns in a sharded checkpoint, as boxes (``tessera.train.sharded_checkpoint``
writes them): each tensor-parallel piece or ZeRO shard of a parameter and of its optimizer
states is a range of the parameter's flattened local tensor, written as the few rectangular
boxes that cover it, each at its offset in the parameter in the model class's own layout;
and the plain entries (optimizer scalars, random number generators) beside them."""

from __future__ import annotations

import dataclasses
import json
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from tessera.train.export import gpt2_tensor_layout

MODEL, STATE, GROUPS = "model.", "optimizer.state.", "optimizer.param_groups"


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def tp_layout(p: torch.Tensor, mesh) -> tuple[int | None, int, int]:
    """(shard dim or None, tp rank, tp size) of a parameter."""
    placements = getattr(p, "placements", ())
    dims = [pl.dim for pl in placements if pl.is_shard()]
    if not dims:
        return None, 0, 1
    return dims[0], mesh.rank("tp"), mesh.size("tp")


def model_identity(model: nn.Module, optimizer=None) -> dict:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        config = {
            k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"
        }
    else:
        config = None
    degree = getattr(model, "_tessera_gpt2_tp_degree", None)
    shapes = {}
    for name, p in model.named_parameters():  # a DTensor reports its global shape
        shape = p.shape
        if degree is not None:  # the model class's own layout, whatever the plan did
            shape = gpt2_tensor_layout(name, torch.empty(shape), degree, to_hf=True).shape
        shapes[name] = list(shape)
    if optimizer is not None:  # a TrainOptimizer: a pipelined rank released other stages' parameters
        shapes |= optimizer.param_shapes
    return {"class": type(model).__name__, "config": config, "shapes": shapes}


# ---- what a rank owns, as boxes ------------------------------------------------------------


def _pieces(optimizer):
    """(param name, kind, local tensor of the piece, start, stop, local shape) this rank owns."""
    engine, mesh = optimizer.engine, optimizer.mesh
    names = {p: n for n, p in optimizer.model.named_parameters()}
    if hasattr(engine, "pieces"):  # a pipelined rank's stages (tessera.train.pipelined)
        return engine.pieces(names, mesh)
    out = []
    for i, cg in enumerate(engine.groups):
        # the chunk's replicas: dp ranks for dense chunks, edp ranks for expert chunks (their
        # experts differ along ep: each ep rank writes its own, placed by its DTensor offset)
        span = getattr(engine, "span", {}).get(cg)
        dp_rank = span.rank if span is not None else mesh.rank("dp")
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
                        piece = flat[a - lo : b - lo]
                        out.append((names[p], kind, piece, a - slot.offset, b - slot.offset, local_shape))
            if engine.zero < 3 and dp_rank == 0:
                local = p.to_local() if hasattr(p, "to_local") else p
                out.append((names[p], "param", local.detach().reshape(-1), 0, numel, local_shape))
            if engine.zero == 0 and dp_rank == 0:
                for kind, v in engine.optimizer.state.get(p, {}).items():
                    if _per_element(v, p):
                        local = v.to_local() if hasattr(v, "to_local") else v
                        out.append((names[p], kind, local.detach().reshape(-1), 0, numel, local_shape))
    return out


def local_box(p: torch.Tensor) -> tuple[list[int], list[int]]:
    """(shape, offset) of this rank's local tensor of ``p`` within the whole parameter: a
    DTensor's (tensor or expert parallel) as DTensor places it, the whole of a plain one."""
    if not hasattr(p, "placements"):
        return list(p.shape), [0] * p.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return list(shape), list(offset)


def _per_element(value, like: torch.Tensor) -> bool:
    local = like.to_local() if hasattr(like, "to_local") else like
    return isinstance(value, torch.Tensor) and value.numel() == local.numel() and value.dim() > 0


def flat_boxes(start: int, stop: int, shape) -> list[tuple[tuple, tuple, int]]:
    """Rectangular boxes (offsets, sizes, flat start) covering elements [start, stop) of a
    row-major tensor of ``shape``, in order; each box is itself a contiguous range."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (stop - start,) if shape else (), start)]
    inner = math.prod(shape[1:])
    out = []

    def rows_part(row: int, a: int, b: int) -> None:  # [a, b) within one row
        for off, size, f in flat_boxes(a, b, shape[1:]):
            out.append(((row, *off), (1, *size), row * inner + f))

    row, pos = divmod(start, inner)
    if pos:
        end = min(stop, (row + 1) * inner)
        rows_part(row, pos, end - row * inner)
        start, row = end, row + 1
    whole = stop // inner
    if whole > row:
        out.append(((row, *[0] * (len(shape) - 1)), (whole - row, *shape[1:]), row * inner))
        start = whole * inner
    if start < stop:
        rows_part(whole, 0, stop - whole * inner)
    return out


_GPT2_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _class_boxes(name: str, offsets: tuple, data: torch.Tensor, degree: int | None, shape) -> list:
    """A box of a parameter of global ``shape`` in this plan's layout -> (offsets, data) boxes
    in the model class's layout (GPT-2 under TP: Linear back to Conv1D, the fused q|k|v rows
    back in order: ``tessera.train.export.gpt2_tensor_layout`` box by box)."""
    layer = next((k for k in _GPT2_LINEARS if name.endswith((f".{k}.weight", f".{k}.bias"))), None)
    if degree is None or layer is None or ".h." not in name:
        return [(tuple(offsets), data)]
    runs = [(offsets[0], 0, data.shape[0])]  # (class row, first box row, rows)
    if layer == "attn.c_attn":
        from tessera.parallel.tp_plans import gpt2_qkv_rows

        rows = gpt2_qkv_rows(shape[0] // 3, degree)[offsets[0] : offsets[0] + data.shape[0]].tolist()
        runs, first = [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                runs.append((rows[first], first, i - first))
                first = i
    if name.endswith(".weight"):
        return [((offsets[1], row), data[a : a + n].t()) for row, a, n in runs]
    return [((row,), data[a : a + n]) for row, a, n in runs]


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's name -> every state_dict name it has (tied weights have several)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


def rank_boxes(model: nn.Module, optimizer) -> dict:
    """{(DCP key, offsets): (CPU copy of the box, the tensor's global shape)} this rank writes."""
    params = dict(model.named_parameters())
    aliases = _aliases(model)
    degree = getattr(model, "_tessera_gpt2_tp_degree", None)
    shapes = model_identity(model, optimizer)["shapes"]
    out = {}
    with optimizer.engine.resident():  # offloaded chunks are in fast memory while copied
        for name, kind, flat, start, stop, local_shape in _pieces(optimizer):
            p = params[name]
            _, origin = local_box(p)
            keys = [MODEL + n for n in aliases[name]] if kind == "param" else [f"{STATE}{name}.{kind}"]
            for offsets, sizes, f in flat_boxes(start, stop, local_shape):
                data = flat[f - start : f - start + math.prod(sizes)].view(sizes)
                offsets = [o + g for o, g in zip(offsets, origin, strict=True)]  # in the whole parameter
                for class_offsets, box in _class_boxes(name, offsets, data, degree, p.shape):
                    copy = box.detach().to("cpu", copy=True).contiguous()  # the snapshot
                    for key in keys:
                        out[(key, tuple(class_offsets))] = (copy, shapes[name])
    return out


class BoxSavePlanner(DefaultSavePlanner):
    """DCP's default planner for the plain entries, plus one write item per box: DCP stores
    each box as a chunk of its tensor (and checks, over all ranks, that the chunks tile it)."""

    def __init__(self, boxes: dict):
        super().__init__()
        self.boxes = boxes

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=box.shape),
                    properties=TensorProperties.create_from_tensor(box),
                    size=torch.Size(shape),
                ),
            )
            for (key, offsets), (box, shape) in self.boxes.items()
        ]
        mappings = dict(plan.planner_data or {})
        mappings.update({key: _path(key) for key, _ in self.boxes})
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items], planner_data=mappings)
        return self.plan

    def resolve_data(self, write_item):
        key = (write_item.index.fqn, tuple(write_item.index.offset or ()))
        if key in self.boxes:
            return self.boxes[key][0]
        return super().resolve_data(write_item)


def _path(key: str) -> tuple:
    """The nested path a flattened key comes from, as torch's own state dicts nest it."""
    if key.startswith(MODEL):
        return ("model", key[len(MODEL) :])
    if key.startswith(STATE):
        name, kind = key[len(STATE) :].rsplit(".", 1)
        return ("optimizer", "state", name, kind)
    return tuple(key.split(".", 1))


def plain_entries(model: nn.Module, optimizer) -> dict:
    """What is not a box: buffers, optimizer scalars and groups (torch's FQN-keyed format),
    this rank's RNG states. DCP writes an entry every rank has once."""
    rank, _ = rank_world()
    out: dict = {}
    params = {n for names in _aliases(model).values() for n in names}
    for name, t in model.state_dict().items():
        if name not in params:
            out[MODEL + name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
    scalars = optimizer_scalars(optimizer)
    group_names = optimizer.group_names
    for names in group_names:
        for name in names:
            for k, v in scalars.items():
                out[f"{STATE}{name}.{k}"] = torch.tensor(v)
    if rank == 0:
        groups = []
        for names, group in zip(group_names, optimizer.engine.optimizer.param_groups, strict=False):
            hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            groups.append({**hyper, "params": list(names)})
        out[GROUPS] = groups  # DCP stores a non-tensor entry as torch.save's bytes
    out |= _rng_entries(rank)
    return out


def _rng_entries(rank: int) -> dict:
    """This rank's generators as tensors (Python's as the bytes of its JSON: nothing pickled)."""
    import random

    out = {f"rng.{rank}.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng.{rank}.cuda"] = torch.cuda.get_rng_state()
    version, state, gauss = random.getstate()
    text = json.dumps([version, list(state), gauss]).encode()
    out[f"rng.{rank}.python"] = torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()
    return out


def set_rng(entries: dict, rank: int) -> None:
    import random

    torch.set_rng_state(entries[f"rng.{rank}.torch"])
    if f"rng.{rank}.cuda" in entries and torch.cuda.is_available():
        torch.cuda.set_rng_state(entries[f"rng.{rank}.cuda"])
    version, state, gauss = json.loads(bytes(entries[f"rng.{rank}.python"].tolist()).decode())
    random.setstate((version, tuple(state), gauss))


def optimizer_scalars(optimizer) -> dict:
    """Non-per-element optimizer state (Adam's step), equal for every parameter."""
    state = optimizer.engine.optimizer.state
    for per_param in state.values():
        return {k: float(v) for k, v in per_param.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
    return {}


