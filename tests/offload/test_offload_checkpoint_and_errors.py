"""A sharded checkpoint of an offloaded run loads under another plan (no offload, or
static offload) and the next step is bit-identical to never stopping; bad budgets,
chunk sizes and directories are refused at ``boost``, before the first step, with the
numbers."""

import dataclasses

import pytest
import torch
from offload_lm import CHUNK_MIB, HOST_MEMORY, batches, master_shards, model, optimizer, train

import tessera
from tessera.train.losses import causal_lm_loss
from tessera.train.sharded_checkpoint import load_sharded, save_sharded

PLAN = tessera.Plan(zero=3, chunk_mib=CHUNK_MIB, max_grad_norm=0.5)


def _offload(plan, tmp, kind="auto"):
    return dataclasses.replace(plan, offload=kind, host_memory=HOST_MEMORY, offload_dir=str(tmp))


def test_checkpoint_of_an_offloaded_run_loads_under_any_plan_bit_exact(tmp_path):
    steps = batches()
    ref_losses, _, _, ref_opt = train(PLAN, steps)  # three steps, never stopped
    _, _, m, opt = train(_offload(PLAN, tmp_path / "a"), steps[:2])
    save_sharded(m, opt, tmp_path / "ckpt")
    for plan in (PLAN, _offload(PLAN, tmp_path / "b", "static")):
        fresh = model()
        fresh, fresh_opt = tessera.boost(fresh, optimizer(fresh), plan)
        load_sharded(fresh, fresh_opt, tmp_path / "ckpt")
        loss = fresh_opt.train_step(steps[2], causal_lm_loss)["loss"]
        assert loss == ref_losses[2], (plan.offload, loss, ref_losses[2])
        for a, b in zip(master_shards(fresh_opt), master_shards(ref_opt), strict=True):
            assert torch.equal(a, b), plan.offload
    # and the optimizer's own state_dict (torch's format) round-trips out of the tiers
    state = opt.state_dict()
    assert len(state["state"]) == sum(1 for p in m.parameters())


def _boost(plan):
    m = model()
    return tessera.boost(m, optimizer(m), plan)


def test_bad_budgets_chunks_and_directories_are_refused_before_training(tmp_path):
    with pytest.raises(
        ValueError, match=r"Plan.host_memory=1000 bytes is below what the largest chunk needs .*\(\d+ bytes"
    ):
        _boost(dataclasses.replace(_offload(PLAN, tmp_path), host_memory=1000))
    with pytest.raises(
        ValueError,
        match=r"Plan.chunk_mib=0.001 holds 263 fp32 elements, below the largest parameter "
        r"transformer.wte.weight \(4096 elements",
    ):
        _boost(dataclasses.replace(_offload(PLAN, tmp_path), chunk_mib=0.001))
    _, opt = _boost(_offload(PLAN, tmp_path))
    with pytest.raises(ValueError, match=r"Plan.host_memory=1000 bytes is below"):
        opt.engine.offload.set_budget(1000)  # a budget lowered between steps is checked alike
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="is not a writable directory"):
        _boost(dataclasses.replace(_offload(PLAN, tmp_path), offload_dir=str(not_a_dir)))
    with pytest.raises(
        ValueError, match="Plan.device_memory=1000000 is for a CUDA device; this mesh computes on cpu"
    ):
        _boost(dataclasses.replace(_offload(PLAN, tmp_path), device_memory=1_000_000))
