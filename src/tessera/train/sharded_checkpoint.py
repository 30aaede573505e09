"""Sharded checkpoints of a boosted model and optimizer in torch's own format
(``torch.distributed.checkpoint``, DCP), loadable under another plan and by plain torch.

Every rank writes only what it owns: its tensor-parallel piece of each parameter (once per
data-parallel group; at ZeRO-3 its shard of each chunk) and its shard of the optimizer
states. A piece is a range of a parameter's flattened local tensor; it is written as the
few rectangular boxes that cover that range (a partial first row, whole rows, a partial last
row, recursively), each placed at its offset in the parameter in the model class's own
layout (HuggingFace's: GPT-2's TP layout change is undone box by box). DCP records those
boxes as the chunks of one global tensor, so any DCP reader — a plain ``torch.nn.Module``
on one process, FSDP2, torchtitan — finds each tensor whole under its usual name:

    model.<state_dict key>                 parameters (tied names too) and persistent buffers
    optimizer.state.<param>.<state>        per-element state (exp_avg, ...) and scalars (step)
    optimizer.param_groups                 torch's FQN-keyed groups (``get_optimizer_state_dict``)
    rng.<rank>.torch / .python / .cuda     each rank's random number generators

which is what ``dcp.load({"model": model.state_dict(), "optimizer":
get_optimizer_state_dict(model, opt)})`` asks for. Loading (here) reads each parameter and
each of its optimizer states whole, a batch of parameters at a time, maps it into this
plan's layout and keeps this rank's piece; it reads checkpoints plain torch wrote the same
way. Values are copied, never recomputed: a round trip is bit-exact.

``config.json`` (Tessera's: format, model class and shapes, plan, world size, optimizer,
the training state of ``tessera.train.train_state``, the caller's ``extra``) is the commit
marker: rank 0 writes it after DCP's ``.metadata``, which DCP writes only once every rank's
files are on disk; the folder is assembled under a temporary name and renamed into place.
A crash mid-save leaves the previous checkpoint. With ``background=True`` the state is
copied at the call (a step boundary) and written by DCP's ``async_save`` while training
goes on; the commit follows in the background.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from tessera.train.checkpoint import CheckpointError, _swap_into_place, read_config
from tessera.train.export import gpt2_tensor_layout
from tessera.train.train_state import restore_train_meta, train_meta

FORMAT = "tessera-dcp"
MODEL, STATE, GROUPS = "model.", "optimizer.state.", "optimizer.param_groups"
LOAD_BATCH_BYTES = 256 * 2**20  # whole tensors held at once while loading, per rank


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


def _local_box(p: torch.Tensor) -> tuple[list[int], list[int]]:
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


def _boxes(model: nn.Module, optimizer) -> dict:
    """{(DCP key, offsets): (CPU copy of the box, the tensor's global shape)} this rank writes."""
    params = dict(model.named_parameters())
    aliases = _aliases(model)
    degree = getattr(model, "_tessera_gpt2_tp_degree", None)
    shapes = _model_identity(model, optimizer)["shapes"]
    out = {}
    with optimizer.engine.resident():  # offloaded chunks are in fast memory while copied
        for name, kind, flat, start, stop, local_shape in _pieces(optimizer):
            p = params[name]
            _, origin = _local_box(p)
            keys = [MODEL + n for n in aliases[name]] if kind == "param" else [f"{STATE}{name}.{kind}"]
            for offsets, sizes, f in flat_boxes(start, stop, local_shape):
                data = flat[f - start : f - start + math.prod(sizes)].view(sizes)
                offsets = [o + g for o, g in zip(offsets, origin, strict=True)]  # in the whole parameter
                for class_offsets, box in _class_boxes(name, offsets, data, degree, p.shape):
                    copy = box.detach().to("cpu", copy=True).contiguous()  # the snapshot
                    for key in keys:
                        out[(key, tuple(class_offsets))] = (copy, shapes[name])
    return out


class _BoxSavePlanner(DefaultSavePlanner):
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


def _plain_entries(model: nn.Module, optimizer) -> dict:
    """What is not a box: buffers, optimizer scalars and groups (torch's FQN-keyed format),
    this rank's RNG states. DCP writes an entry every rank has once."""
    rank, _ = _rank_world()
    out: dict = {}
    params = {n for names in _aliases(model).values() for n in names}
    for name, t in model.state_dict().items():
        if name not in params:
            out[MODEL + name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
    scalars = _scalars(optimizer)
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


def _set_rng(entries: dict, rank: int) -> None:
    import random

    torch.set_rng_state(entries[f"rng.{rank}.torch"])
    if f"rng.{rank}.cuda" in entries and torch.cuda.is_available():
        torch.cuda.set_rng_state(entries[f"rng.{rank}.cuda"])
    version, state, gauss = json.loads(bytes(entries[f"rng.{rank}.python"].tolist()).decode())
    random.setstate((version, tuple(state), gauss))


def _scalars(optimizer) -> dict:
    """Non-per-element optimizer state (Adam's step), equal for every parameter."""
    state = optimizer.engine.optimizer.state
    for per_param in state.values():
        return {k: float(v) for k, v in per_param.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
    return {}


# ---- saving --------------------------------------------------------------------------------


class PendingSave:
    """A checkpoint being written in the background; ``wait()`` returns its path once this
    rank's part is written and (rank 0) the checkpoint committed, or raises what failed."""

    def __init__(self, path: Path, commit):
        self.path = path
        self._commit = commit
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, future) -> None:
        try:
            future.result()
            if self._commit is not None:
                self._commit()
        except BaseException as exc:  # noqa: BLE001 - raised again in wait()
            self._error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint {self.path} was not written within {timeout}s")
        if self._error is not None:
            raise self._error
        return self.path


def save_sharded(
    model: nn.Module,
    optimizer,
    path: str | Path,
    *,
    scheduler=None,
    extra: dict | None = None,
    background: bool = False,
    process_group=None,
) -> Path | PendingSave:
    """Every rank calls this; see the module doc. ``scheduler`` (an LR scheduler) is saved
    with the groups' hyper-parameters, the fp16 loss scale and every rank's RNG states
    (``tessera.train.train_state``); ``extra`` (JSON) is kept in config.json.

    ``background``: copy the state now and return a :class:`PendingSave` while DCP's
    ``async_save`` writes it over ``process_group`` (give one of its own, e.g.
    ``torch.distributed.new_group(backend="gloo")``, so that its collectives never meet
    training's)."""
    rank, world = _rank_world()
    path = Path(path)
    staging = path.with_name(f".{path.name}.partial")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    train = train_meta(optimizer, scheduler)  # every rank: a JSON error is raised everywhere
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
    json.dumps(meta)  # not JSON: refused before anything is written
    boxes, entries = _boxes(model, optimizer), _plain_entries(model, optimizer)
    _barrier()  # the stale staging folder is gone everywhere before anyone writes

    def commit() -> None:
        _write_marker(staging, meta)
        _swap_into_place(staging, path)

    writer = FileSystemWriter(staging)
    planner = _BoxSavePlanner(boxes)
    if not background:
        try:
            with _one_process_is_fine():
                dcp.save(
                    entries,
                    storage_writer=writer,
                    planner=planner,
                    process_group=process_group,
                    no_dist=not dist.is_initialized(),
                )
        except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
            raise _first_failure(exc, path) from None
        if rank == 0:
            commit()
        _barrier()
        return path
    future = dcp.async_save(
        entries,
        storage_writer=writer,
        planner=planner,
        process_group=process_group,
        no_dist=not dist.is_initialized(),
    )
    future = getattr(future, "upload_completion", future)
    pending = PendingSave(path, commit if rank == 0 else None)
    future.add_done_callback(pending._finish)
    return pending


def _first_failure(exc: CheckpointException, path: Path) -> BaseException:
    """The error a rank met inside torch.distributed.checkpoint (e.g. OSError: disk full),
    as itself, with a note naming the rank and the checkpoint."""
    rank, (first, _) = min(exc.failures.items(), key=lambda item: item[0])
    first.add_note(f"while saving {path} (rank {rank}, inside torch.distributed.checkpoint)")
    return first


def _write_marker(folder: Path, meta: dict) -> None:
    """config.json, durably: written beside, flushed to disk, renamed (the commit)."""
    tmp = folder / ".config.json.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(meta, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / "config.json")


# ---- loading -------------------------------------------------------------------------------


def _read_metadata(path: Path):
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: the folder does not exist")
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint: DCP's .metadata is missing (a save that did not finish?)"
        )
    try:
        md = FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - whatever unpickling raised
        raise CheckpointError(f"{path / '.metadata'} is corrupt: {exc}") from None
    files = sorted({info.relative_path for info in md.storage_data.values()})
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is incomplete: {name} is missing (it holds {len(files)} files)")
    return md


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


def _check_tensors(path: Path, md, shapes: dict) -> dict[str, list[str]]:
    """Each parameter's DCP keys (its value, then its optimizer states), checked to be there,
    of its shape and wholly covered by chunks; the error names what is not."""
    problems, keys = [], {}
    for name, shape in shapes.items():
        entry = md.state_dict_metadata.get(MODEL + name)
        if not isinstance(entry, TensorStorageMetadata):
            problems.append(f"{name} (no pieces)")
            continue
        if list(entry.size) != list(shape):
            raise CheckpointError(
                f"{path} is from a different model: {name} is {list(entry.size)} there, {list(shape)} here"
            )
        states = [
            k
            for k, v in md.state_dict_metadata.items()
            if k.startswith(f"{STATE}{name}.") and isinstance(v, TensorStorageMetadata)
        ]
        keys[name] = [MODEL + name, *sorted(states)]
        for key in keys[name]:
            e = md.state_dict_metadata[key]
            missing = math.prod(e.size) - sum(math.prod(c.sizes) for c in e.chunks)
            if missing:
                problems.append(f"{key[len(MODEL) :] if key.startswith(MODEL) else key} ({missing} elements)")
    if problems:
        raise CheckpointError(
            f"{path} does not cover every tensor: missing {', '.join(problems[:5])}"
            + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
        )
    return keys


def _batches(keys: dict, md) -> list[list[str]]:
    """Parameters in batches of at most LOAD_BATCH_BYTES of whole tensors (the same on every
    rank: each call of dcp.load is a collective)."""
    out, size = [[]], 0
    for name, ks in keys.items():
        nbytes = sum(
            math.prod(md.state_dict_metadata[k].size) * md.state_dict_metadata[k].properties.dtype.itemsize
            for k in ks
        )
        if out[-1] and size + nbytes > LOAD_BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return out


def load_sharded(model: nn.Module, optimizer, path: str | Path, *, scheduler=None) -> dict:
    """Load parameters and optimizer state saved under any plan (by Tessera, or by plain torch
    as ``{"model": ..., "optimizer": ...}``) into this boosted model and optimizer (every rank
    calls it), and the training state ``save_sharded`` kept (RNG states only at the world size
    they were saved at); returns the checkpoint's config (for a plain torch checkpoint, one
    that says so)."""
    path = Path(path)
    md = _read_metadata(path)
    if (path / "config.json").is_file():
        meta = read_config(path, FORMAT)
        _check_identity(path, meta, model, optimizer)
    else:  # written by plain torch: its own names and shapes are the identity
        meta = {"format": "torch-dcp", "plan": None, "world": None, "gpt2_tp_degree": None, "extra": {}}
    shapes = _model_identity(model, optimizer)["shapes"]
    keys = _check_tensors(path, md, shapes)
    params = dict(model.named_parameters())
    degree = getattr(model, "_tessera_gpt2_tp_degree", None)
    engine, mesh = optimizer.engine, optimizer.mesh
    with engine.resident():  # offloaded chunks are in fast memory while loading
        for batch in _batches(keys, md):
            request = {
                k: torch.empty(
                    tuple(md.state_dict_metadata[k].size), dtype=md.state_dict_metadata[k].properties.dtype
                )
                for name in batch
                if name in params
                for k in keys[name]
            }
            _load(request, path)
            for name in batch:
                if name in params:
                    _place(name, params[name], request, keys[name], degree, engine, mesh)
    if "train" in meta:
        restore_train_meta(meta["train"], optimizer, scheduler)
    else:
        _restore_plain_groups(path, md, optimizer)
    rank, world = _rank_world()
    meta["rng_restored"] = world == meta["world"]
    if meta["rng_restored"]:
        wanted = {k: v for k, v in md.state_dict_metadata.items() if k.startswith(f"rng.{rank}.")}
        request = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in wanted.items()}
        _load(request, path)
        _set_rng(request, rank)
    return meta


class _JSONLikeBytesPlanner(DefaultLoadPlanner):
    """Reads torch.save'd entries with ``weights_only=True`` (plain data, no code run)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value) -> None:
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _restore_plain_groups(path: Path, md, optimizer) -> None:
    """The optimizer groups' hyper-parameters (an LR scheduler's lr, ...) from a checkpoint
    plain torch saved with ``get_optimizer_state_dict`` (DCP flattens them to
    ``optimizer.param_groups.<i>.<name>``): group by group, when the counts agree."""
    prefix = GROUPS + "."
    request: dict = {
        k: None
        for k, v in md.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(v, BytesStorageMetadata)
    }
    if not request:
        return
    with _one_process_is_fine():
        dcp.load(
            request,
            storage_reader=FileSystemReader(path),
            planner=_JSONLikeBytesPlanner(),
            no_dist=not dist.is_initialized(),
        )
    groups: dict[int, dict] = {}
    for key, value in request.items():
        index, _, name = key[len(prefix) :].partition(".")
        if index.isdigit() and name and name not in ("params", "param_names"):
            groups.setdefault(int(index), {})[name] = value
    if sorted(groups) == list(range(len(optimizer.inner.param_groups))):
        restore_train_meta({"param_groups": [groups[i] for i in sorted(groups)]}, optimizer)


def _load(request: dict, path: Path) -> None:
    with _one_process_is_fine():
        dcp.load(request, storage_reader=FileSystemReader(path), no_dist=not dist.is_initialized())


@contextlib.contextmanager
def _one_process_is_fine():
    """DCP warns that it assumes one process when there is no group: here that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _place(name: str, p, request: dict, keys: list[str], degree, engine, mesh) -> None:
    """One parameter's whole tensors (class layout) -> this plan's layout -> this rank's piece."""
    scalars = {k.rsplit(".", 1)[1]: float(request[k]) for k in keys if request[k].dim() == 0}
    for key in keys:
        full = request[key]
        if full.dim() == 0:
            continue
        kind = "param" if key.startswith(MODEL) else key.rsplit(".", 1)[1]
        if degree is not None:
            full = gpt2_tensor_layout(name, full, degree, to_hf=False)
        shape, offset = _local_box(p)
        local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        engine.load_local(p, kind, local.to(_device(p)).contiguous(), scalars)


def _device(p: torch.Tensor) -> torch.device:
    return (p.to_local() if hasattr(p, "to_local") else p).device
