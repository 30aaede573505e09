"""Tiered chunks: one mechanism that moves a chunk's bytes between the compute tier, host
memory and disk, as ``placement``'s policy says, within each tier's budget.

A ``TieredChunk`` wraps the tensor the training code holds (a ZeRO-3 master shard, a
gradient shard, an optimizer moment). It always keeps that tensor object, so optimizers
and views never see a swap: off the compute tier its storage is resized to zero, and a
fetch gives the storage back and reads the bytes into it. Every use goes through
``use`` (state COMPUTE: pinned on the compute tier) and ``done`` (a HOLD state, or
RELEASED for data that is consumed); state changes go through the chunk manager.

The slow tier keeps a chunk's bytes after a fetch, so evicting a chunk that was only read
(a parameter shard after its all-gather) writes nothing. A prefetch reserves room on the
main thread, then reads on one background thread while compute runs; ``use`` waits for
it. Tiers (CPU-only: host, then disk; CUDA: device, pinned host, then disk) are filled
fastest first: a chunk evicted from a full tier moves one tier down.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessera.memory.chunk import ChunkKind, ChunkState
from tessera.memory.placement import StaticPolicy, TracePolicy
from tessera.memory.tiers import DiskTier, Tier, TierFull
from tessera.memory.track import resident_bytes


@dataclass(eq=False)
class TieredChunk:
    key: str
    kind: ChunkKind
    tensor: torch.Tensor
    nbytes: int
    tier: int = 0  # index of the tier holding the data
    state: ChunkState = ChunkState.FREE
    saved: bool = False  # the disk file holds the current bytes
    host: torch.Tensor | None = None  # CUDA: its copy in host memory
    pending: Future | None = None

    def __repr__(self) -> str:
        return f"chunk {self.key} ({self.kind.value}, {self.nbytes} bytes)"


@dataclass
class Moves:
    read: int = 0
    written: int = 0
    fetches: int = 0
    evictions: int = 0
    prefetches: int = 0
    waited_s: float = 0.0
    read_by_kind: dict = field(default_factory=dict)  # ChunkKind value -> bytes read

    def snapshot(self) -> dict:
        return {**self.__dict__, "read_by_kind": dict(self.read_by_kind)}


@dataclass
class TieredStore:
    tiers: list[Tier]  # compute tier first; a DiskTier, if any, last
    policy: object
    manager: object  # ChunkManager: every state change goes through its ``transition``
    chunks: dict[str, TieredChunk] = field(default_factory=dict)
    moves: Moves = field(default_factory=Moves)

    def __post_init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-prefetch")
        self.compute_bytes = 0  # whole chunks gathered for compute (reserved, not movable)
        self.log: list[tuple] = []  # the uses of the steps recorded (``record``), in order
        self.recording = 0  # steps still to record

    def record(self, steps: int) -> None:
        """Log every use of the next ``steps`` steps (the engine's own order of uses, which
        ``tessera.memory.dry_run.replay`` runs again under other budgets)."""
        self.log, self.recording = [], steps

    def _note(self, *entry) -> None:
        if self.recording:
            self.log.append(entry)

    @property
    def disk(self) -> DiskTier | None:
        return self.tiers[-1] if isinstance(self.tiers[-1], DiskTier) else None

    # ---- the uses ---------------------------------------------------------------------------
    def register(self, key: str, kind: ChunkKind, tensor: torch.Tensor) -> TieredChunk:
        """A new chunk whose data ``tensor`` holds now, on the compute tier, in use."""
        assert key not in self.chunks, key
        nbytes = tensor.numel() * tensor.element_size()
        self._note("register", key, kind, tensor.numel(), tensor.dtype)
        chunk = TieredChunk(key, kind, tensor, nbytes)
        self._make_room(0, nbytes, keep=chunk, what=repr(chunk))
        self.tiers[0].reserve(nbytes, repr(chunk))
        self.chunks[key] = chunk
        self.manager.transition(chunk, ChunkState.COMPUTE)
        self.policy.on_use(key, self._nonmodel())
        return chunk

    def use(self, key: str, *, write: bool = False, fresh: bool = False) -> torch.Tensor:
        """The chunk's tensor, on the compute tier; ``fresh``: the caller overwrites all of
        it, so a chunk off the tier gets its room back without being read."""
        self._note("use", key, write, fresh)
        chunk = self.chunks[key]
        self.policy.on_use(key, self._nonmodel())
        self._fetch(chunk, read=not fresh)
        write = write or fresh
        self.manager.transition(chunk, ChunkState.COMPUTE)
        if write:
            chunk.saved = False
        self._prefetch()
        return chunk.tensor

    def done(self, key: str, state: ChunkState) -> None:
        self._note("done", key, state)
        chunk = self.chunks[key]
        self.manager.transition(chunk, state)
        if state is ChunkState.RELEASED:
            self._drop(chunk)
        elif self.policy.eager and len(self.tiers) > 1:
            self._evict(chunk)

    def reserve_compute(self, nbytes: int, what: str) -> None:
        """Room for a whole chunk gathered for compute (not movable until freed)."""
        self._note("reserve", nbytes, what)
        self._make_room(0, nbytes, keep=None, what=what)
        self.tiers[0].reserve(nbytes, what)
        self.compute_bytes += nbytes

    def release_compute(self, nbytes: int) -> None:
        self._note("release", nbytes)
        self.tiers[0].release(nbytes)
        self.compute_bytes -= nbytes

    def end_step(self) -> None:
        self._note("end_step")
        self.recording = max(0, self.recording - 1)
        self.policy.end_step()

    # ---- moving -----------------------------------------------------------------------------
    def _movable(self, tier: int, keep) -> list[str]:
        return [
            k
            for k, c in self.chunks.items()
            if c.tier == tier
            and c is not keep
            and c.state not in (ChunkState.COMPUTE, ChunkState.RELEASED)
            and (c.pending is None or c.pending.done())  # a read in flight cannot be undone
        ]

    def _make_room(self, tier: int, nbytes: int, *, keep, what: str, before: float | None = None) -> bool:
        """Evict from ``tier`` until ``nbytes`` fit; with ``before`` only chunks next used
        later than that (a prefetch): False if that is not enough."""
        t = self.tiers[tier]
        while nbytes > t.room():
            movable = self._movable(tier, keep)
            if before is not None:
                movable = [k for k in movable if self.policy.next_use(k) > before]
            elif not movable and self._finish_reads(tier, keep):
                continue  # prefetches in flight held the room; landed, they may leave
            if not movable or tier == len(self.tiers) - 1:
                if before is not None:
                    return False
                if t.measuring:
                    return True  # the caller's reserve records the shortfall
                t.reserve(nbytes, what)  # raises TierFull with the numbers
            self._evict(self.chunks[self.policy.victim(movable)])
        return True

    def _finish_reads(self, tier: int, keep) -> bool:
        """Wait for the reads in flight into ``tier`` (a read cannot be undone, so its
        chunk cannot leave before it lands); True if there were any. Without this a
        prefetch could make a later request fail that fits once the read is done."""
        waiting = [
            c
            for c in self.chunks.values()
            if c.tier == tier and c is not keep and c.pending is not None and not c.pending.done()
        ]
        began = time.perf_counter()
        for c in waiting:
            c.pending.result()
        self.moves.waited_s += time.perf_counter() - began
        return bool(waiting)

    # ---- measuring the warm-up step ---------------------------------------------------------
    def measure(self, on: bool) -> None:
        """While on, a tier past its budget records the shortfall instead of raising."""
        for t in self.tiers:
            t.measuring = on and t is not self.disk

    @property
    def measuring(self) -> bool:
        return self.tiers[0].measuring

    def shortfall(self) -> tuple[Tier, int, str] | None:
        """The first tier (fastest first) that needed more than its budget while measured:
        (tier, bytes its chunks in use held at once, the request that made it)."""
        for t in self.tiers:
            if t.shortfall is not None and t.budget is not None and t.shortfall[0] > t.budget:
                return t, *t.shortfall
        return None

    def _evict(self, chunk: TieredChunk) -> None:
        """One tier down: compute tier -> host (CUDA) or disk, host -> disk. Bytes are
        written only where the slow copy is stale."""
        if chunk.state is ChunkState.COMPUTE or chunk.tier == len(self.tiers) - 1:
            return
        self._land(chunk)  # a finished prefetch, not used after all
        down = chunk.tier + 1
        if self.tiers[down] is not self.disk:  # CUDA: device -> pinned host memory
            self._make_room(down, chunk.nbytes, keep=chunk, what=repr(chunk))
            self.tiers[down].reserve(chunk.nbytes, repr(chunk))
            chunk.host = _host_like(chunk.tensor)
            chunk.host.copy_(chunk.tensor)
        else:
            data = chunk.host if chunk.host is not None else chunk.tensor
            if not chunk.saved:
                self.disk.write(chunk.key, data)
                chunk.saved = True
                self.moves.written += chunk.nbytes
        if chunk.tier == 0:
            self._free_storage(chunk.tensor)
        else:
            chunk.host = None
        self.tiers[chunk.tier].release(chunk.nbytes)
        chunk.tier = down
        self.moves.evictions += 1

    def _fetch(self, chunk: TieredChunk, read: bool = True) -> None:
        if chunk.pending is not None:
            began = time.perf_counter()
            self._land(chunk)
            self.moves.waited_s += time.perf_counter() - began
        if chunk.tier == 0:
            return
        self._make_room(0, chunk.nbytes, keep=chunk, what=repr(chunk))
        if not read and chunk.host is None:  # on disk, about to be overwritten: room only
            self.tiers[0].reserve(chunk.nbytes, repr(chunk))
            self._restore_storage(chunk.tensor)
            chunk.tier = 0
            return
        chunk.pending = self._start_fetch(chunk)
        self._land(chunk)

    def _land(self, chunk: TieredChunk) -> None:
        """Wait for the chunk's read in flight. A read that failed leaves the chunk on disk
        as it was (its file still current), so the store stays consistent and the error
        (a disk fault, a crash injected into a save) does not leave garbage counted as data."""
        if chunk.pending is None:
            return
        pending, chunk.pending = chunk.pending, None
        try:
            pending.result()
        except BaseException:
            self._unfetch(chunk)
            raise

    def _unfetch(self, chunk: TieredChunk) -> None:
        assert chunk.saved and self.disk is not None, chunk  # only reads from disk are undone
        self._free_storage(chunk.tensor)
        self.tiers[0].release(chunk.nbytes)
        chunk.tier, chunk.host = len(self.tiers) - 1, None

    def _start_fetch(self, chunk: TieredChunk) -> Future:
        """Reserve and give back the storage now; a read from disk into a CPU chunk runs
        on the prefetch thread (CUDA: read into pinned memory, then copied on the stream)."""
        self.tiers[0].reserve(chunk.nbytes, repr(chunk))
        self._restore_storage(chunk.tensor)
        source, chunk.tier = chunk.tier, 0
        self.moves.read += chunk.nbytes
        kind = chunk.kind.value
        self.moves.read_by_kind[kind] = self.moves.read_by_kind.get(kind, 0) + chunk.nbytes
        self.moves.fetches += 1
        if chunk.host is None:  # on disk
            if chunk.tensor.device.type != "cuda":
                return self.pool.submit(self.disk.read_into, chunk.key, chunk.tensor)
            chunk.host = _host_like(chunk.tensor)
            try:
                self.disk.read_into(chunk.key, chunk.host)
            except BaseException:
                self._unfetch(chunk)
                raise
        else:  # in host memory (CUDA), which it now leaves
            self.tiers[source].release(chunk.nbytes)
        chunk.tensor.copy_(chunk.host, non_blocking=True)
        chunk.host = None
        done: Future = Future()
        done.set_result(None)
        return done

    def _prefetch(self) -> None:
        for key in self.policy.prefetch():
            chunk = self.chunks.get(key)
            if chunk is None or chunk.tier == 0 or chunk.pending is not None:
                continue
            mine = self.policy.next_use(key)
            if not self._make_room(0, chunk.nbytes, keep=chunk, what=repr(chunk), before=mine):
                return
            chunk.pending = self._start_fetch(chunk)
            self.moves.prefetches += 1

    def _drop(self, chunk: TieredChunk) -> None:
        """Consumed data: gone from every tier."""
        with contextlib.suppress(Exception):  # a failed read of data being dropped is moot
            self._land(chunk)
        if chunk.tier == 0:
            self.tiers[0].release(chunk.nbytes)
            self._free_storage(chunk.tensor)
        elif chunk.host is not None:
            self.tiers[chunk.tier].release(chunk.nbytes)
        if chunk.saved and self.disk is not None:
            self.disk.remove(chunk.key)
        del self.chunks[chunk.key]

    # ---- whole-state access (checkpoints) ---------------------------------------------------
    @contextlib.contextmanager
    def all_resident(self):
        """Every chunk on the compute tier, budget suspended (saving, loading); evicted
        back to the budget after."""
        states = {k: c.state for k, c in self.chunks.items()}
        try:
            with self.unbounded():
                try:
                    for k in list(self.chunks):
                        self.use(k, write=True)
                    yield
                finally:  # also after a failure midway (a save that crashed): states back
                    for k, c in list(self.chunks.items()):
                        if c.state is ChunkState.COMPUTE:  # also chunks made meanwhile (a loaded state)
                            before = states.get(k, ChunkState.HOLD)
                            self.done(k, ChunkState.HOLD if before is ChunkState.FREE else before)
        finally:
            self.settle()

    @contextlib.contextmanager
    def unbounded(self):
        """The compute tier's budget suspended meanwhile (whole-model access, not a step's
        uses: not recorded)."""
        budget, self.tiers[0].budget = self.tiers[0].budget, None
        recording, self.recording = self.recording, 0
        try:
            yield
        finally:
            self.tiers[0].budget, self.recording = budget, recording

    def set_budget(self, nbytes: int) -> None:
        """A new budget for the compute tier (e.g. once the warm-up measured what else lives
        there); chunks that may move leave now, TierFull if the ones in use do not fit."""
        self.tiers[0].budget = nbytes
        self.settle()
        if self.tiers[0].room() < 0:
            self.tiers[0].reserve(0, "the chunks in use")

    def settle(self) -> None:
        """Evict what may move until the compute tier is within its budget again."""
        while self.tiers[0].room() < 0 and (movable := self._movable(0, None)):
            self._evict(self.chunks[self.policy.victim(movable)])

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()

    # ---- helpers ----------------------------------------------------------------------------
    def _nonmodel(self) -> int:
        """Bytes on the compute tier that are not chunks (activations, temporaries, runtime)."""
        device = self.tiers[0].device
        if device.type == "cuda":
            total = torch.cuda.memory_allocated(device) if torch.cuda.is_available() else 0
        else:
            total = resident_bytes()
        return max(0, total - self.tiers[0].used)

    @staticmethod
    def _free_storage(t: torch.Tensor) -> None:
        t.untyped_storage().resize_(0)

    @staticmethod
    def _restore_storage(t: torch.Tensor) -> None:
        t.untyped_storage().resize_(t.numel() * t.element_size())


def _host_like(t: torch.Tensor) -> torch.Tensor:
    """Room in host memory for ``t`` (pinned, for asynchronous copies; meta in a dry run)."""
    if t.device.type == "meta":
        return torch.empty_like(t)
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


__all__ = ["TieredChunk", "TieredStore", "TierFull", "Moves"]


def check_device_memory(device: torch.device, device_memory: int | None) -> None:
    if device.type != "cuda" and device_memory is not None:
        raise ValueError(
            f"Plan.device_memory={device_memory} is for a CUDA device; this mesh computes on {device.type}: "
            "use Plan.host_memory"
        )


def build_store(
    manager,
    *,
    policy: str,
    device: torch.device,
    device_memory: int | None,
    host_memory: int | None,
    offload_dir: str | os.PathLike | None,
    rank: int,
    disk_need: int,
) -> TieredStore:
    """Tiers fastest first: CUDA device (``device_memory``), host (``host_memory``; pinned
    on CUDA), disk under ``offload_dir/rank<r>`` (the last tier: where everything else goes)."""
    check_device_memory(device, device_memory)
    tiers = [Tier("device", device_memory, device)] if device.type == "cuda" else []
    tiers.append(Tier("host", host_memory, torch.device("cpu")))
    if offload_dir is not None:
        tiers.append(DiskTier(Path(offload_dir) / f"rank{rank}", disk_need))
    return TieredStore(tiers, TracePolicy() if policy == "auto" else StaticPolicy(), manager)
