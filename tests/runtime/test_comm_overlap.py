"""ZeRO's flat collectives asynchronously (``all_gather_into`` / ``reduce_scatter_into`` with
``async_op=True``): the same results as the synchronous calls, and under a link model the
ledger's account of how much link time was hidden (``Ledger.hidden``): none when the caller
waits at once, nearly all of it when compute runs between issue and wait. Times are asserted
as test_link.py asserts them: the emulated waits only, with slack a stalled machine cannot
break the wrong way."""

import time

import pytest
import torch

from tessera.runtime import Mesh, spawn
from tessera.runtime.link import Link

SLOW = Link(name="slow", bandwidth=1e6, latency=0.0)  # 1 MB/s: 100 KB takes 0.1 s
ELEMS = 25_000  # float32: 100 KB, one all-gather shard on 2 ranks: T on the wire
T = 0.1


def _flat_calls() -> dict:
    mesh = Mesh(x=2)
    comm, me, out = mesh.comm, mesh.global_rank, {}
    shard = torch.arange(ELEMS, dtype=torch.float32) + me
    whole = torch.cat([torch.arange(ELEMS, dtype=torch.float32) + r for r in range(2)])
    comm.emulate(SLOW)
    for label, async_op in (("sync", False), ("async", True)):
        comm.barrier()
        comm.ledger.reset()
        gathered = torch.empty(2 * ELEMS)
        work = comm.all_gather_into(gathered, shard, "x", async_op=async_op)
        if async_op:
            time.sleep(2 * T)  # compute between issue and wait
            work.wait()
        out[f"{label}_gather"] = comm.ledger.hidden()
        out[f"{label}_gather_ok"] = torch.equal(gathered, whole)
        reduced = torch.empty(ELEMS)
        work = comm.reduce_scatter_into(reduced, whole * (me + 1), "x", async_op=async_op)
        if async_op:
            work.wait()
        out[f"{label}_reduce_ok"] = torch.equal(reduced, 3 * whole[me * ELEMS : (me + 1) * ELEMS])
    comm.emulate(None)
    out["one_rank"] = Mesh(one=1, x=2).comm.all_gather_into(
        torch.empty(3), torch.ones(3), "one", async_op=True
    )
    return out


def test_async_flat_calls_match_and_their_hidden_link_time_is_counted():
    rank0, rank1 = spawn(_flat_calls, 2, timeout_s=120)
    for r in (rank0, rank1):
        assert r["sync_gather_ok"] and r["async_gather_ok"] and r["sync_reduce_ok"] and r["async_reduce_ok"]
        for label in ("sync", "async"):
            # the link time issued is the formula's, exactly the same sum: (n-1) x 100 KB at 1 MB/s
            assert r[f"{label}_gather"]["link_s"] == pytest.approx(T)  # float64 rounding only
        # waited for at once: the whole transfer exposed (0.5T fails only on a 50 ms stall
        # between two clock reads after the real call); overlapped with 2T of compute: ~none
        assert r["sync_gather"]["exposed_s"] > 0.5 * T and r["sync_gather"]["hidden_fraction"] < 0.5
        assert r["async_gather"]["exposed_s"] < 0.2 * T and r["async_gather"]["hidden_fraction"] > 0.8
        assert r["async_gather"]["blocked_s"] >= r["async_gather"]["exposed_s"]
    assert rank0["one_rank"] is not None  # an axis of one rank: a work that is done at once
