"""A training loop that picks up where it stopped: ``resume_or_start`` and its ``Checkpointer``.

Checkpoints of one run live in one directory, a folder per step::

    DIR/step-00000040/     a committed checkpoint (tessera.train.sharded_checkpoint: DCP's
    DIR/step-00000060/     files, then config.json, the commit marker, then the rename)
    DIR/.step-00000080.partial   one being written (or left by a kill): never "latest"

``resume_or_start`` loads the newest committed one (every rank calls it; the plan may differ
from the one that saved it) and says which step to run next; ``Checkpointer.save`` takes a
snapshot at a step boundary and writes it in the background (DCP's ``async_save`` over a
process group of its own), commits it once every rank's part is on disk, and prunes all but
the newest ``keep``. Under torchrun's elastic agent (``tessera launch --max-restarts N``)
every restarted rank does the same by itself, so the job goes on from the last commit.

The data position is the step: a loop whose batch ``i`` is a function of ``i`` (as the
recipes' are, and a ``DistributedSampler`` with ``set_epoch`` is) sees no sample twice and
skips none when it starts again at ``checkpointer.step``. A loop with other state (a
stateful data loader) passes it as ``data_state`` (JSON) and gets it back.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.train.checkpoint import CheckpointError
from tessera.train.sharded_checkpoint import PendingSave, load_sharded, save_sharded

STEP_DIR = re.compile(r"^step-(\d{8})$")
PARTIAL_DIR = re.compile(r"^\.step-(\d{8})\.partial$")


def step_folder(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def committed(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and (entry / "config.json").is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest(directory: str | Path) -> Path | None:
    """The newest committed checkpoint in ``directory``, or None."""
    found = committed(directory)
    return found[-1][1] if found else None


def checkpoint_bytes(model: torch.nn.Module, optimizer) -> int:
    """About the bytes one checkpoint takes: every parameter and each of its per-element
    optimizer states (the ones the optimizer holds now; two, as Adam's, before its first step)."""
    from tessera.train.checkpoint_boxes import model_identity

    shapes = model_identity(model, optimizer)["shapes"]
    numel = sum(int(torch.Size(s).numel()) for s in shapes.values())
    itemsize = max((p.element_size() for p in model.parameters()), default=4)
    first = next(iter(optimizer.inner.state.values()), None)
    kinds = 2 if first is None else sum(torch.is_tensor(v) and v.dim() > 0 for v in first.values())
    return numel * itemsize * (1 + kinds)


def _free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


def check_directory(directory: str | Path, need: int) -> Path:
    """Refuse, in one line with the numbers, a directory one cannot write a checkpoint to."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"checkpoint directory {directory} is not writable ({exc.strerror or exc}); "
            "give --checkpoint-dir a folder this user can write"
        ) from None
    free = _free_bytes(directory)
    if free < need:
        raise ValueError(
            f"checkpoint directory {directory} has {free / 2**20:.1f} MiB free; one checkpoint of this "
            f"model and optimizer needs about {need / 2**20:.1f} MiB"
        )
    return directory


class Checkpointer:
    """Saves a boosted model and optimizer every ``every`` steps into ``directory`` (see the
    module doc). ``step`` is the step to run next; ``data_state`` what the checkpoint it
    resumed from was given as ``data_state`` (None when it started afresh)."""

    def __init__(
        self,
        model,
        optimizer,
        directory: Path,
        *,
        scheduler=None,
        every: int | None = None,
        keep: int = 2,
        background: bool = True,
    ):
        if every is not None and every < 1:
            raise ValueError(f"checkpoint every must be a positive number of steps, got {every}")
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (the latest checkpoint), got {keep}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.directory, self.every, self.keep, self.background = Path(directory), every, keep, background
        self.step, self.data_state, self.resumed_from = 0, None, None
        self._pending: PendingSave | None = None
        # DCP's collectives in the background must never meet training's: a group of their own
        self._group = dist.new_group(backend="gloo") if background and dist.is_initialized() else None

    def due(self, step: int) -> bool:
        """Whether a loop that has just finished ``step`` steps should save now."""
        return self.every is not None and step % self.every == 0

    def save(
        self, step: int, *, data_state: dict | None = None, extra: dict | None = None, wait=False
    ) -> None:
        """Every rank calls this after ``step`` optimizer steps, at a step boundary. The state
        is copied now; the write goes on in the background (unless ``background`` was False or
        ``wait``). A save still in flight is finished first (its error, if any, raised here)."""
        self.wait()
        record = {"step": step, "data": data_state, **(extra or {})}
        target = step_folder(self.directory, step)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if not self.background:
            save_sharded(self.model, self.optimizer, target, scheduler=self.scheduler, extra=record)
            if rank0:
                self._prune()
            return
        pending = save_sharded(
            self.model,
            self.optimizer,
            target,
            scheduler=self.scheduler,
            extra=record,
            background=True,
            process_group=self._group,
        )
        if rank0:
            commit = pending._commit
            pending._commit = lambda: (commit(), self._prune())
        self._pending = pending
        if wait:
            self.wait()

    def maybe_save(self, step: int, **kwargs) -> bool:
        """``save`` if ``due(step)``; True if it saved."""
        if self.due(step):
            self.save(step, **kwargs)
            return True
        return False

    def wait(self) -> None:
        """Finish the save in flight (raising what failed in it)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def _prune(self) -> None:
        """Rank 0, after a commit: all but the newest ``keep`` committed checkpoints go, and
        every partial one (nothing else is in flight now)."""
        for _, folder in committed(self.directory)[: -self.keep]:
            shutil.rmtree(folder, ignore_errors=True)
        for entry in self.directory.iterdir():
            if PARTIAL_DIR.match(entry.name):
                shutil.rmtree(entry, ignore_errors=True)


def resume_or_start(
    model,
    optimizer,
    directory: str | Path | None = None,
    *,
    scheduler=None,
    every: int | None = None,
    keep: int = 2,
    background: bool = True,
) -> Checkpointer:
    """Every rank calls this after ``tessera.boost``: the directory is checked (writable, room
    for one checkpoint: a one-line ValueError with the numbers otherwise), the newest committed
    checkpoint in it, if any, is loaded into ``model``/``optimizer``/``scheduler`` (under this
    plan, whatever plan saved it; a checkpoint of another model is a CheckpointError naming
    what differs), and the returned Checkpointer says which ``step`` to run next::

        ckpt = tessera.train.resume_or_start(model, opt, "runs/ckpt", every=50)
        for step in range(ckpt.step, total):
            opt.train_step(batch(step), loss_fn)
            ckpt.maybe_save(step + 1)
        ckpt.save(total, wait=True)

    ``directory`` None and ``every`` None: those ``tessera launch --checkpoint-dir DIR
    --checkpoint-every STEPS`` gave (a ValueError where there are none).
    """
    directory, every = _from_launch(directory, every)
    # every rank looks for itself (the directory is shared, as DCP needs): no save is in
    # flight when a run starts, so they all see the same folders
    directory = check_directory(directory, checkpoint_bytes(model, optimizer))
    checkpointer = Checkpointer(
        model, optimizer, directory, scheduler=scheduler, every=every, keep=keep, background=background
    )
    found = latest(directory)
    if found is not None:
        meta = load_sharded(model, optimizer, found, scheduler=scheduler)
        record = meta.get("extra", {})
        if "step" not in record:
            raise CheckpointError(f"{found} records no step (it was not saved by a Checkpointer)")
        checkpointer.step, checkpointer.data_state = int(record["step"]), record.get("data")
        checkpointer.resumed_from = found
    return checkpointer


def _from_launch(directory, every):
    from tessera.runtime.launch_cli import CHECKPOINT_DIR_ENV, CHECKPOINT_EVERY_ENV

    if directory is None:
        directory = os.environ.get(CHECKPOINT_DIR_ENV)
        if directory is None:
            raise ValueError(
                "resume_or_start needs a checkpoint directory: pass one, or launch with "
                "`tessera launch --checkpoint-dir DIR`"
            )
    if every is None and os.environ.get(CHECKPOINT_EVERY_ENV):
        every = int(os.environ[CHECKPOINT_EVERY_ENV])
    return Path(directory), every


def describe(checkpointer: Checkpointer) -> str:
    """One line for a log: where the run starts."""
    if checkpointer.resumed_from is None:
        return f"starting at step 0 (no checkpoint in {checkpointer.directory})"
    return f"resumed from step {checkpointer.step} ({checkpointer.resumed_from})"


__all__ = ["Checkpointer", "committed", "describe", "latest", "resume_or_start"]
