"""Plan before running: the bytes each tier holds, the bytes moved per step and the
predicted peak of an offloaded ZeRO-3 rank, without touching data.

A dry run replays a log of store uses (``TieredStore.record``: register, use, done, the
compute tier's room for whole chunks, end of step) through the very ``TieredStore`` and
policy training uses, over data-less chunks (meta tensors, a disk tier that counts instead
of writing), under the budgets asked about. The log is the engine's own:

- once training has run its warm-up step, the uses that step (and the next) recorded;
- before training, the uses ``ShardOffload`` makes (the code training runs, over meta
  tensors, every collective a no-op) when driven in the order ZeRO-3's hooks drive it
  before they have learned one: forward in chunk order, backward in reverse, each chunk
  gathered whole, the next ``prefetch`` gathered ahead, its gradient shard made and the
  chunk freed, then the clipped step chunk by chunk (``ShardOffload.step``; clipping
  assumed to scale, the case that writes).

Three steps run (the log's steps, its last one repeated): the last one's moves are the
steady state (the first is the warm-up that records the trace). If a chunk cannot be
placed, the dry run refuses with the tier, the request and the budget.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from tessera.memory.chunk import ChunkKind, ChunkState
from tessera.memory.chunk_manager import ChunkManager
from tessera.memory.store import build_store
from tessera.memory.tiers import DiskTier, Tier, TierFull, check_dir

MiB = 2**20


@dataclass
class MemoryReport:
    tiers: dict[str, int]  # bytes of model data each tier holds between steps
    budgets: dict[str, int | None]
    read: int  # bytes fetched into the compute tier per step
    written: int  # bytes written back per step
    chunk_peak: int  # the compute tier's peak of model data
    nonmodel: int  # activations and other non-model bytes added at the peak (estimate)
    chunks: int

    @property
    def predicted_peak(self) -> int:
        return self.chunk_peak + self.nonmodel

    def text(self) -> str:
        lines = [f"{'tier':<8}{'budget MiB':>12}{'holds MiB':>12}"]
        for name, held in self.tiers.items():
            budget = self.budgets.get(name)
            lines.append(
                f"{name:<8}{'-' if budget is None else f'{budget / MiB:.1f}':>12}{held / MiB:>12.1f}"
            )
        lines += [
            f"chunks per rank: {self.chunks}",
            f"moved per step: {(self.read + self.written) / MiB:.1f} MiB "
            f"(read {self.read / MiB:.1f}, written {self.written / MiB:.1f})",
            f"predicted peak on the compute tier: {self.predicted_peak / MiB:.1f} MiB "
            f"(model data {self.chunk_peak / MiB:.1f} + non-model {self.nonmodel / MiB:.1f})",
        ]
        return "\n".join(lines)


class _CountingDisk(DiskTier):
    """A disk tier that only counts (its directory and free space are checked apart)."""

    def write(self, key, tensor):
        pass

    def read_into(self, key, tensor):
        pass

    def remove(self, key):
        pass


def dry_run(
    param_groups: list[dict],
    *,
    dp: int,
    chunk_elems: int,
    policy: str,
    device: torch.device,
    device_memory: int | None = None,
    host_memory: int | None = None,
    offload_dir: str | None = None,
    clip: bool = False,
    state_tensors: int = 2,
    nonmodel: int = 0,
    segment_of=None,
    prefetch: int = 0,
) -> MemoryReport:
    """One rank's plan (ranks hold equal shards). ``state_tensors``: per-element optimizer
    states per parameter (Adam 2, SGD with momentum 1); ``nonmodel``: bytes of activations
    and the like at the peak, added to it (``estimate_gpt2_activations`` for GPT-2)."""
    meta_groups = [{"params": [p for p in g["params"] if p.requires_grad]} for g in param_groups]
    manager = ChunkManager(meta_groups, chunk_elems=chunk_elems, align=dp, segment_of=segment_of)
    shard_numels = [cg.chunk.capacity // dp for cg in manager.chunks]
    whole = [cg.chunk.capacity * 4 for cg in manager.chunks]
    if offload_dir is not None:  # refuses an unwritable or too small directory
        check_dir(offload_dir, (2 + state_tensors) * 4 * sum(shard_numels))
    log = engine_log(whole, shard_numels, state_tensors=state_tensors, clip=clip, prefetch=prefetch)
    return replay(
        manager,
        log,
        shard_numels,
        policy=policy,
        device=device,
        device_memory=device_memory,
        host_memory=host_memory,
        disk=offload_dir is not None,
        nonmodel=nonmodel,
    )


def replay(
    manager,
    log: list[tuple],
    shard_numels: list[int],
    *,
    policy: str,
    device: torch.device,
    device_memory: int | None,
    host_memory: int | None,
    disk: bool,
    nonmodel: int = 0,
) -> MemoryReport:
    """Run ``log`` (its whole steps, the last one repeated up to three) through a store of
    these budgets over meta tensors, after registering the fp32 master shards of
    ``shard_numels`` as training does before its first step; ``disk``: a disk tier below
    (counting only). A chunk the log registers again in a later step (an optimizer state,
    a bf16 copy) is used and written instead. ValueError with the numbers if a use cannot
    be placed. ``tessera.memory.offload.check_offload`` runs it before set-up."""
    steps = whole_steps(log)
    if not steps:
        raise ValueError("the log holds no whole step to replay")
    steps += [steps[-1]] * (3 - len(steps))
    store = build_store(
        manager,
        policy=policy,
        device=device,
        device_memory=device_memory,
        host_memory=host_memory,
        offload_dir=None,
        rank=0,
        disk_need=0,
    )
    if disk:
        counting = _CountingDisk.__new__(_CountingDisk)
        Tier.__init__(counting, "disk", None, torch.device("cpu"))  # the space is checked apart
        store.tiers.append(counting)
    before = {}
    try:
        for i, n in enumerate(shard_numels):
            store.register(f"p{i}", ChunkKind.PARAM, torch.empty(n, device="meta"))
            store.done(f"p{i}", ChunkState.HOLD)
        for step in steps:
            before = store.moves.snapshot()
            _run(store, step)
    except TierFull as e:
        raise ValueError(f"nothing fits: {e}") from None
    finally:
        store.pool.shutdown(wait=True)
    moves = store.moves.snapshot()
    held = {t.name: 0 for t in store.tiers}
    for c in store.chunks.values():
        held[store.tiers[c.tier].name] += c.nbytes
    if store.disk is not None:
        held["disk"] = sum(
            c.nbytes for c in store.chunks.values() if c.saved or c.tier == len(store.tiers) - 1
        )
    return MemoryReport(
        tiers=held,
        budgets={t.name: t.budget for t in store.tiers if t.name != "disk"},
        read=moves["read"] - before["read"],
        written=moves["written"] - before["written"],
        chunk_peak=store.tiers[0].peak,
        nonmodel=nonmodel,
        chunks=len(shard_numels),
    )


def whole_steps(log: list[tuple]) -> list[list[tuple]]:
    """The log cut after each end of step (a step still being recorded is left out)."""
    steps, current = [], []
    for entry in log:
        current.append(entry)
        if entry[0] == "end_step":
            steps.append(current)
            current = []
    return steps


def _run(store, step: list[tuple]) -> None:
    reserved: Counter[int] = Counter()  # room the log asked for: a release without one is left out
    for op, *args in step:
        if op == "register":
            key, kind, numel, dtype = args
            if key in store.chunks:
                store.use(key, write=True)
            else:
                store.register(key, kind, torch.empty(numel, dtype=dtype, device="meta"))
        elif op == "use":
            key, write, fresh = args
            store.use(key, write=write, fresh=fresh)
        elif op == "done":
            store.done(*args)
        elif op == "reserve":
            store.reserve_compute(*args)
            reserved[args[0]] += 1
        elif op == "release":
            if reserved[args[0]]:  # a chunk left whole before the log began (gather_all) is not
                reserved[args[0]] -= 1
                store.release_compute(args[0])
        else:
            store.end_step()


def engine_log(
    whole: list[int],
    shard_numels: list[int],
    *,
    state_tensors: int,
    clip: bool,
    prefetch: int,
    steps: int = 2,
) -> list[tuple]:
    """The store uses of ``steps`` training steps of one rank's offloaded ZeRO-3 chunks
    (``whole``: bytes of each whole fp32 chunk, ``shard_numels``: its shard), made by
    ``ShardOffload`` itself over meta tensors in the order the module doc gives."""
    from tessera.memory.offload import ShardOffload

    class DryOffload(ShardOffload):
        def _norm(self, total):  # a meta tensor has no value: clipping assumed to scale
            return math.inf

    shards = [nn.Parameter(torch.empty(n, device="meta")) for n in shard_numels]
    store = build_store(
        ChunkManager([], chunk_elems=1, align=1),
        policy="static",
        device=torch.device("cpu"),
        device_memory=None,
        host_memory=None,  # unbounded: the uses do not depend on the budgets
        offload_dir=None,
        rank=0,
        disk_need=0,
    )
    offload = DryOffload(store, _StatesOnly(shards, state_tensors), shards)
    offload.whole = list(whole)
    buffers = [torch.empty(w // 4, device="meta") for w in whole]
    store.record(steps)
    try:
        for step in range(steps):
            n = len(shards)
            # the first forward gathers each chunk where it is used (no order learned yet)
            _drive(offload, buffers, list(range(n)), ChunkState.HOLD_AFTER_FWD, prefetch if step else 0)
            _drive(offload, buffers, list(reversed(range(n))), ChunkState.HOLD_AFTER_BWD, prefetch)
            offload.step(_NoComm(), "dp", 1.0 if clip else None, torch.device("meta"))
    finally:
        store.pool.shutdown(wait=True)
    return store.log


def _drive(offload, buffers, order: list[int], after: ChunkState, ahead: int) -> None:
    """One pass of ZeRO-3's hooks over the chunks in ``order``: each gathered whole (unless
    prefetched), the next ``ahead`` gathered meanwhile, freed after use; in backward (after
    HOLD_AFTER_BWD) its gradient shard made first."""
    comm, in_flight = _NoComm(), {}
    for k, i in enumerate(order):
        finish = in_flight.pop(i, None)
        if finish is not None:
            finish()
        else:
            offload.reserve(i)
            offload.gather_into(buffers[i], i, after, comm, "dp")
        for j in order[k + 1 : k + 1 + ahead]:
            if j not in in_flight:
                offload.reserve(j)
                in_flight[j] = offload.gather_into(buffers[j], j, after, comm, "dp", async_op=True)
        if after is ChunkState.HOLD_AFTER_BWD:
            offload.reduced_into(i, lambda out: None)
        offload.release(i)


class _NoComm:
    """Collectives that move nothing (the dry run's chunks have no data)."""

    def all_gather_into(self, out, shard, axis, async_op=False):
        return _Done() if async_op else None

    def all_reduce(self, tensor, axis, op="sum"):
        pass


class _Done:
    def wait(self):
        pass


class _StatesOnly:
    """What the dry run needs of an elementwise optimizer: per stepped parameter,
    ``state_tensors`` states of its shape, made by its first step."""

    def __init__(self, params: list[nn.Parameter], state_tensors: int):
        self.params, self.state_tensors = params, state_tensors
        self.state: dict = {}

    def step(self):
        for p in self.params:
            if p.grad is not None and p not in self.state:
                self.state[p] = {f"state{k}": torch.empty_like(p) for k in range(self.state_tensors)}


def estimate_gpt2_activations(
    *, layers: int, width: int, heads: int, vocab: int, batch: int, seq: int
) -> int:
    """fp32 activations a GPT-2 step keeps for backward: Korthikanti et al. (2022) count
    s·b·h·(34 + 5·a·s/h) bytes per layer at 16 bits; fp32 doubles it. Plus the logits, their
    softmax and its gradient (3 x b·s·V x 4 bytes)."""
    per_layer = seq * batch * width * (34 + 5 * heads * seq / width) * 2
    return int(layers * per_layer + 3 * batch * seq * vocab * 4)
