"""Training with offload equals training without it, bit for bit: the store moves bytes
but every value is computed by the same ops in the same order (the chunk-by-chunk step
runs the user's AdamW on one shard at a time; torch's CPU AdamW treats each tensor on its
own). So the tolerance is zero, on 1 rank and on 2 (gloo), with a host budget (120 kB
for 830 kB of model data) that evicts and re-fetches chunks of every kind every step;
the moves are counted. Also: gradient accumulation, global-norm clipping, activation
checkpointing, a tied embedding, an unused parameter, and the budget is kept (the host
tier's peak). Under bf16 autocast offload gathers bf16 copies of the masters, which is not
bit-exact: test_offload_bf16_copies.py, with its tolerance.
"""

import dataclasses

import pytest
import torch
from offload_lm import CHUNK_MIB, HOST_MEMORY, adam_states, batches, master_shards, train

import tessera
from tessera.runtime import spawn

BASE = dict(zero=3, chunk_mib=CHUNK_MIB, grad_accum=2, max_grad_norm=0.5)  # 0.5 < grad norms: clipping acts


def _offloaded(plan: tessera.Plan, tmp, kind="auto") -> tessera.Plan:
    return dataclasses.replace(plan, offload=kind, host_memory=HOST_MEMORY, offload_dir=str(tmp))


def _same(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"{what} {i}: max diff {(x - y).abs().max()}"


def _check_moves(moves, chunks):
    """Every step read and wrote back more than the whole rank's parameters (so every kind
    was evicted and fetched), and the first steps' moves did not stop after warm-up."""
    per_step = [moves[0]] + [
        {k: b[k] - a[k] for k in ("read", "written", "fetches")}
        for a, b in zip(moves, moves[1:], strict=False)
    ]
    for step in per_step:
        assert step["fetches"] >= chunks, per_step


@pytest.mark.parametrize("precision,recompute", [("fp32", False), ("fp32", True)])
def test_one_rank_offload_is_bit_exact(tmp_path, precision, recompute):
    plan = tessera.Plan(**BASE, precision=precision, activation_checkpointing=recompute)
    steps = batches()
    ref_losses, _, _, ref_opt = train(plan, steps)
    for kind in ("auto", "static"):
        losses, moves, _, opt = train(_offloaded(plan, tmp_path / kind, kind), steps)
        assert losses == ref_losses, (kind, losses, ref_losses)
        _same(master_shards(opt), master_shards(ref_opt), f"{kind} master shard")
        _same(adam_states(opt), adam_states(ref_opt), f"{kind} Adam state")
        store = opt.engine.offload.store
        _check_moves(moves, len(opt.engine.groups))
        assert moves[-1]["peak"] <= HOST_MEMORY, moves[-1]
        assert store.tiers[1].name == "disk"
        if kind == "auto":
            assert moves[-1]["prefetches"] > 0
            auto_moves = moves[-1]["read"] - moves[0]["read"]
        else:
            static_moves = moves[-1]["read"] - moves[0]["read"]
    assert auto_moves < static_moves  # the trace's placement moves less than static offload


def _two_ranks(tmp):
    plan = tessera.Plan(dp=2, **{**BASE, "grad_accum": 1})
    steps = batches()
    ref_losses, _, _, ref_opt = train(plan, steps)
    losses, moves, _, opt = train(_offloaded(plan, tmp), steps)
    rank = opt.mesh.rank("dp")
    files = sorted(p.name for p in (tmp / f"rank{rank}").glob("*.bin"))
    return (
        losses == ref_losses,
        [torch.equal(a, b) for a, b in zip(master_shards(opt), master_shards(ref_opt), strict=True)],
        [torch.equal(a, b) for a, b in zip(adam_states(opt), adam_states(ref_opt), strict=True)],
        moves,
        len(opt.engine.groups),
        moves[-1]["peak"],
        files,
        sum(s.numel() for s in opt.engine.shards),
    )


def test_two_ranks_offload_their_own_shards_bit_exact(tmp_path):
    results = spawn(_two_ranks, 2, tmp_path, timeout_s=300)
    sizes = set()
    for same_losses, same_params, same_states, moves, chunks, peak, files, elems in results:
        assert same_losses and all(same_params) and all(same_states)
        _check_moves(moves, chunks)
        assert peak <= HOST_MEMORY
        assert any(f.startswith("p") for f in files) and any(f.startswith("s") for f in files)
        sizes.add(elems)
    assert len(sizes) == 1  # each rank holds its own half: equal shards
