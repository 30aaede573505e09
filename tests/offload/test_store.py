"""Tiers, the tiered store and placement on plain tensors (no training): a chunk evicted
to disk comes back bit-identical into the same tensor object; budgets are kept and a
request past one is refused with the numbers; Belady moves fewer bytes than static
offload for the same use order; Plan's offload settings are validated."""

import os
import time

import pytest
import torch

import tessera
from tessera.memory.chunk import ChunkKind, ChunkState
from tessera.memory.chunk_manager import ChunkManager
from tessera.memory.placement import StaticPolicy, TracePolicy, simulate
from tessera.memory.store import TieredStore
from tessera.memory.tiers import DiskTier, Tier, TierFull

KIB = 1024


def _store(tmp_path, budget, policy):
    tiers = [Tier("host", budget, torch.device("cpu")), DiskTier(tmp_path, 1 << 20)]
    return TieredStore(tiers, policy, ChunkManager([], chunk_elems=1, align=1))


def _chunks(store, n):
    torch.manual_seed(0)
    values = [torch.randn(256) for _ in range(n)]  # 1 KiB each
    for i, v in enumerate(values):
        store.register(f"c{i}", ChunkKind.PARAM, v.clone())
        store.done(f"c{i}", ChunkState.HOLD)
    return values


def test_evicted_chunk_returns_bit_identical_into_the_same_tensor(tmp_path):
    store = _store(tmp_path, 2 * KIB, TracePolicy())
    values = _chunks(store, 4)  # 4 KiB of chunks, 2 KiB of budget
    assert store.tiers[0].used <= 2 * KIB and store.moves.written == 2 * KIB
    held = store.chunks["c0"].tensor
    assert held.untyped_storage().nbytes() == 0  # evicted: its storage is gone
    got = store.use("c0")
    assert got is held and torch.equal(got, values[0])
    store.done("c0", ChunkState.HOLD)
    assert store.tiers[0].peak <= 2 * KIB
    for i in (1, 2, 3):
        store.use(f"c{i}")
        store.done(f"c{i}", ChunkState.HOLD)
    assert store.moves.written == 4 * KIB  # each written once, when first evicted
    # chunks only read are clean: evicting them again writes nothing
    for i in (0, 1, 2, 3):
        store.use(f"c{i}")
        store.done(f"c{i}", ChunkState.HOLD)
    assert store.moves.written == 4 * KIB and store.moves.fetches >= 6
    store.close()


def test_a_request_past_the_budget_names_tier_request_and_budget(tmp_path):
    store = _store(tmp_path, 1536, StaticPolicy())
    _chunks(store, 1)
    store.use("c0")  # in use: cannot move
    with pytest.raises(
        TierFull, match=r"host tier: chunk c1 .* needs 1024 bytes, 1024 of the budget of 1536"
    ):
        store.register("c1", ChunkKind.GRAD, torch.zeros(256))
    store.close()


def test_a_read_in_flight_is_waited_for_not_a_reason_to_fail(tmp_path):
    """A prefetch's read cannot be undone, so its chunk cannot leave until it lands; a
    request that needs its room waits for it instead of failing (on the tiny GPT-2 a
    75 kB budget once failed mid-step this way, in the optimizer step)."""
    store = _store(tmp_path, 2 * KIB, TracePolicy())
    values = _chunks(store, 4)  # c2, c3 resident; c0, c1 on disk
    slow_read = store.disk.read_into

    def read_into(key, tensor):
        time.sleep(0.3)
        slow_read(key, tensor)

    store.disk.read_into = read_into
    store.use("c0")  # in use: 1 KiB pinned
    c1 = store.chunks["c1"]
    assert store._make_room(0, KIB, keep=c1, what="c1")
    c1.pending = store._start_fetch(c1)  # a prefetch, reading now: the tier is full
    assert not c1.pending.done()
    assert torch.equal(store.use("c2"), values[2])  # waits for c1's read, then evicts it
    store.done("c0", ChunkState.HOLD)
    store.done("c2", ChunkState.HOLD)
    assert torch.equal(store.use("c1"), values[1])
    store.close()


def test_transitions_only_through_the_chunk_manager(tmp_path):
    store = _store(tmp_path, 4 * KIB, StaticPolicy())
    _chunks(store, 1)
    with pytest.raises(AssertionError, match="hold -> hold_after_bwd"):
        store.done("c0", ChunkState.HOLD_AFTER_BWD)  # not in use: nothing to be done with
    store.close()


def test_belady_moves_fewer_bytes_than_static():
    sizes = {k: 100 for k in "abcd"}
    # forward a b c d, backward d c b a, step a b c d (writes)
    uses = [(k, False) for k in "abcd"] + [(k, False) for k in "dcba"] + [(k, True) for k in "abcd"]
    static = simulate(uses, sizes, 200, StaticPolicy())
    belady = simulate(uses, sizes, 200, TracePolicy())
    assert static.fetches == 12 and static.written == 400
    assert belady.fetched < static.fetched and belady.peak <= 200
    with pytest.raises(ValueError, match="needs 100 bytes, the fast tier has 50"):
        simulate(uses, sizes, 50, TracePolicy())


def test_plan_offload_settings_are_validated(tmp_path):
    tessera.Plan(zero=3, offload="auto", host_memory=1 << 20, offload_dir=str(tmp_path))
    bad = [
        (dict(offload="nvme"), "Plan.offload must be one of"),
        (dict(zero=2, offload="auto"), "moves ZeRO-3 chunks .* got zero=2; use zero=3"),
        (dict(zero=3, offload="static", host_memory=-5), "Plan.host_memory must be a positive"),
        (dict(zero=3, offload="auto", host_memory=1 << 20), "need a disk tier: set Plan.offload_dir"),
        (dict(zero=3, host_memory=1 << 20), "Plan.offload is None"),
        (dict(zero=3, offload="auto", precision="fp16"), "fp16"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            tessera.Plan(**kwargs)


def test_offload_dir_not_writable_or_too_small_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permissions do not bind")
        with pytest.raises(ValueError, match="is not a writable directory"):
            DiskTier(locked, 1)
    finally:
        os.chmod(locked, 0o700)
    with pytest.raises(ValueError, match=r"bytes free, the plan writes \d+"):
        DiskTier(tmp_path, 1 << 62)
