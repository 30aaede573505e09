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
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    TensorStorageMetadata,
)

from tessera.train.checkpoint import CheckpointError, _swap_into_place, read_config
from tessera.train.checkpoint_boxes import (
    GROUPS,
    MODEL,
    STATE,
    BoxSavePlanner,
    local_box,
    model_identity,
    optimizer_scalars,
    plain_entries,
    rank_boxes,
    rank_world,
    set_rng,
)
from tessera.train.export import gpt2_tensor_layout
from tessera.train.train_state import restore_train_meta, train_meta

FORMAT = "tessera-dcp"
LOAD_BATCH_BYTES = 256 * 2**20  # whole tensors held at once while loading, per rank


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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
    rank, world = rank_world()
    path = Path(path)
    staging = path.with_name(f".{path.name}.partial")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    train = train_meta(optimizer, scheduler)  # every rank: a JSON error is raised everywhere
    meta = {
        "format": FORMAT,
        "model": model_identity(model, optimizer),
        "plan": optimizer.plan.to_dict(),
        "world": world,
        "gpt2_tp_degree": getattr(model, "_tessera_gpt2_tp_degree", None),
        "optimizer": type(optimizer.engine.optimizer).__name__,
        "scalars": optimizer_scalars(optimizer),
        "train": train,
        "extra": extra or {},
    }
    json.dumps(meta)  # not JSON: refused before anything is written
    boxes, entries = rank_boxes(model, optimizer), plain_entries(model, optimizer)
    _barrier()  # the stale staging folder is gone everywhere before anyone writes

    def commit() -> None:
        _write_marker(staging, meta)
        _swap_into_place(staging, path)

    writer = FileSystemWriter(staging)
    planner = BoxSavePlanner(boxes)
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
    mine = model_identity(model, optimizer)
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
    shapes = model_identity(model, optimizer)["shapes"]
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
    rank, world = rank_world()
    meta["rng_restored"] = world == meta["world"]
    if meta["rng_restored"]:
        wanted = {k: v for k, v in md.state_dict_metadata.items() if k.startswith(f"rng.{rank}.")}
        request = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in wanted.items()}
        _load(request, path)
        set_rng(request, rank)
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
        shape, offset = local_box(p)
        local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        engine.load_local(p, kind, local.to(_device(p)).contiguous(), scalars)


def _device(p: torch.Tensor) -> torch.device:
    return (p.to_local() if hasattr(p, "to_local") else p).device
