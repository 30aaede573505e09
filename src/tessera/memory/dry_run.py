"""Plan before running: the bytes each tier holds, the bytes moved per step and the
predicted peak of an offloaded ZeRO-3 rank, without touching data.

The model's parameters (a model on the ``meta`` device is enough) are packed into the
same chunks training makes; the very ``TieredStore`` and policy training uses then run
over data-less chunks (meta tensors, a disk tier that counts instead of writing) through
one step's sequence of uses as ``tessera.parallel.zero`` makes them: forward (each master
shard fetched for its all-gather, with room for the whole chunk), backward (again, then
its gradient shard made), clipping (every gradient read, then scaled), the step (master,
gradient, each optimizer state; the gradient dropped). Three steps run: the last one's
moves are the steady state (the first is the warm-up that records the trace). If a chunk
cannot be placed, the dry run refuses with the tier, the request and the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
) -> MemoryReport:
    """One rank's plan (ranks hold equal shards). ``state_tensors``: per-element optimizer
    states per parameter (Adam 2, SGD with momentum 1); ``nonmodel``: bytes of activations
    and the like at the peak, added to it (``estimate_gpt2_activations`` for GPT-2)."""
    meta_groups = [{"params": [p for p in g["params"] if p.requires_grad]} for g in param_groups]
    manager = ChunkManager(meta_groups, chunk_elems=chunk_elems, align=dp, segment_of=segment_of)
    shard_numels = [cg.chunk.capacity // dp for cg in manager.chunks]
    if offload_dir is not None:  # refuses an unwritable or too small directory
        check_dir(offload_dir, (2 + state_tensors) * 4 * sum(shard_numels))
    return simulate_step(
        manager,
        [cg.chunk.capacity * 4 for cg in manager.chunks],
        shard_numels,
        policy=policy,
        device=device,
        device_memory=device_memory,
        host_memory=host_memory,
        disk=offload_dir is not None,
        clip=clip,
        state_tensors=state_tensors,
        nonmodel=nonmodel,
    )


def simulate_step(
    manager,
    whole: list[int],
    shard_numels: list[int],
    *,
    policy: str,
    device: torch.device,
    device_memory: int | None,
    host_memory: int | None,
    disk: bool,
    clip: bool = False,
    state_tensors: int = 2,
    nonmodel: int = 0,
) -> MemoryReport:
    """Three steps of one rank's uses (``whole``: bytes of each whole chunk; its fp32 shard
    of ``shard_numels``) through the store and policy training uses, over meta tensors;
    ``disk``: a disk tier below (counting only). ValueError with the numbers if a use
    cannot be placed. ``tessera.memory.offload.check_offload`` runs it before set-up."""
    shards = [torch.empty(n, device="meta") for n in shard_numels]
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
    try:
        for i, s in enumerate(shards):
            store.register(f"p{i}", ChunkKind.PARAM, s)
            store.done(f"p{i}", ChunkState.HOLD)
        before = {}
        for step in range(3):
            before = store.moves.snapshot()
            _step(store, whole, shards, clip, state_tensors, first=step == 0)
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
        chunks=len(shards),
    )


def _step(store, whole, shards, clip, state_tensors, *, first):
    n = len(shards)

    def gathered(i, after):
        store.reserve_compute(whole[i], f"whole chunk {i} for compute")
        store.use(f"p{i}")
        store.done(f"p{i}", after)
        store.release_compute(whole[i])

    for i in range(n):
        gathered(i, ChunkState.HOLD_AFTER_FWD)
    for i in reversed(range(n)):
        store.reserve_compute(whole[i], f"whole chunk {i} for compute")
        store.use(f"p{i}")
        store.done(f"p{i}", ChunkState.HOLD_AFTER_BWD)
        store.register(f"g{i}", ChunkKind.GRAD, torch.empty_like(shards[i]))
        store.done(f"g{i}", ChunkState.HOLD_AFTER_BWD)
        store.release_compute(whole[i])
    for rounds in range(2 if clip else 0):
        for i in range(n):
            store.use(f"g{i}", write=rounds == 1)
            store.done(f"g{i}", ChunkState.HOLD_AFTER_BWD)
    for i in range(n):
        store.use(f"p{i}", write=True)
        store.use(f"g{i}")
        keys = [f"s{i}.{k}" for k in range(state_tensors)]
        for key in keys:
            if first:
                store.register(key, ChunkKind.OPTIM, torch.empty_like(shards[i]))
            else:
                store.use(key, write=True)
        store.done(f"p{i}", ChunkState.HOLD)
        store.done(f"g{i}", ChunkState.RELEASED)
        for key in keys:
            store.done(key, ChunkState.HOLD)
    store.end_step()


def estimate_gpt2_activations(
    *, layers: int, width: int, heads: int, vocab: int, batch: int, seq: int
) -> int:
    """fp32 activations a GPT-2 step keeps for backward: Korthikanti et al. (2022) count
    s·b·h·(34 + 5·a·s/h) bytes per layer at 16 bits; fp32 doubles it. Plus the logits, their
    softmax and its gradient (3 x b·s·V x 4 bytes)."""
    per_layer = seq * batch * width * (34 + 5 * heads * seq / width) * 2
    return int(layers * per_layer + 3 * batch * seq * vocab * 4)
