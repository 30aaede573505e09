"""The offload dry run is the engine's own order of uses replayed (tessera.memory.dry_run):
once training has stepped, the uses the store recorded (register, use, done, room for whole
chunks) run again over meta tensors under any budget; before training, ShardOffload's own
methods over meta tensors, driven in chunk order."""

import pytest
import torch
from offload_lm import CHUNK_MIB, HOST_MEMORY, batches, train

import tessera
from tessera.memory.dry_run import engine_log, replay, whole_steps


def _plan(tmp_path) -> tessera.Plan:
    return tessera.Plan(
        zero=3, chunk_mib=CHUNK_MIB, max_grad_norm=0.5, offload="static", host_memory=HOST_MEMORY,
        offload_dir=str(tmp_path),
    )  # fmt: skip


def _replay(offload, log, budget):
    _, numels, _ = offload.layout
    return replay(
        offload.store.manager, log, numels, policy="static", device=torch.device("cpu"),
        device_memory=None, host_memory=budget, disk=True,
    )  # fmt: skip


def _fits(offload, log, budget) -> bool:
    try:
        _replay(offload, log, budget)
        return True
    except ValueError:
        return False


def test_the_recorded_steps_replay_to_the_runs_own_moves_and_peak(tmp_path):
    plan = _plan(tmp_path)
    _, moves, _, opt = train(plan, batches(n=3))
    offload = opt.engine.offload
    recorded = whole_steps(offload.store.log)
    assert len(recorded) == 2  # the warm-up step and the next; the third is not recorded
    report = _replay(offload, offload.store.log, HOST_MEMORY)
    # the static policy moves chunks by the uses alone: the replay over meta tensors makes
    # the very moves the run made in its last step, byte for byte, and reaches its peak
    assert report.read == moves[2]["read"] - moves[1]["read"]
    assert report.written == moves[2]["written"] - moves[1]["written"]
    assert report.chunk_peak == moves[2]["peak"]
    assert report.read > 0 and report.written > 0


def test_a_budget_the_recorded_steps_do_not_fit_is_refused_between_steps(tmp_path):
    """The tied embedding's chunk stays whole from the first module to the last, which the
    chunk-order log does not know: a budget it would accept is refused once the engine's
    own uses are recorded, before any chunk moves (else a later step would fail midway)."""
    plan = _plan(tmp_path)
    _, _, m, opt = train(plan, batches(n=1))
    offload = opt.engine.offload
    whole, numels, states = offload.layout
    generated = engine_log(whole, numels, state_tensors=states, clip=True, prefetch=plan.prefetch)
    recorded = offload.store.log
    assert len(whole_steps(recorded)) == 1
    lowest = {}
    for name, log in (("generated", generated), ("recorded", recorded)):
        lo, hi = 0, HOST_MEMORY  # the lowest budget each log fits, to 64 bytes
        while hi - lo > 64:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _fits(offload, log, mid) else (mid, hi)
        lowest[name] = hi
    assert lowest["generated"] + 1000 < lowest["recorded"], lowest
    between = (lowest["generated"] + lowest["recorded"]) // 2
    with pytest.raises(ValueError, match=f"Plan.host_memory={between} refused before training \\(dry run\\)"):
        offload.set_budget(between)
    assert offload.store.tiers[0].budget == HOST_MEMORY  # refused: unchanged
    offload.set_budget(lowest["recorded"] + 64)
    from tessera.train.losses import causal_lm_loss

    loss = opt.train_step(batches(seed=5, n=1)[0], causal_lm_loss)["loss"]  # the next step fits
    assert torch.isfinite(torch.tensor(loss))
    assert offload.store.tiers[0].peak <= HOST_MEMORY


def test_the_plan_memory_dry_run_counts_the_chunks_gathered_ahead(tmp_path):
    """memory_report drives ShardOffload as the engine will, prefetch included: each chunk
    gathered ahead holds its whole chunk (and the shard it comes from) at the same time."""
    from offload_lm import model as tiny_model

    from tessera.train.plan import memory_report

    peaks = {}
    for prefetch in (0, 2):
        plan = tessera.Plan(
            zero=3, chunk_mib=CHUNK_MIB, offload="static", host_memory=10**9, offload_dir=str(tmp_path),
            prefetch=prefetch,
        )  # fmt: skip
        peaks[prefetch] = memory_report(tiny_model(), plan).chunk_peak
    # 11 chunks of ~16.8 kB whole: two more in flight hold at least two more whole chunks
    assert peaks[2] >= peaks[0] + 2 * 4000 * 4, peaks
