"""Training that survives a lost process (#33): asynchronous, atomic checkpoints with a commit
marker and pruning; a kill during a checkpoint write; elastic restarts under torchrun's agent
that end bit-exactly where an uninterrupted run ends; collectives that hang or lose a peer
turned into errors naming the rank, the operation and the mesh axis; bad input refused.

Tolerance: every comparison is exact (rtol=0, atol=0): a checkpoint stores the bits it is
given, and a resumed run repeats the uninterrupted run's operations in the same order on the
same plan, so its parameters are the same bits.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_lm import SEQ, VOCAB, tiny_gpt2

import tessera
from tessera.runtime import RankError, spawn
from tessera.train import resume
from tessera.train import sharded_checkpoint as sc
from tessera.train.checkpoint import CheckpointError
from tessera.train.export import full_state_dict
from tessera.train.losses import causal_lm_loss

SCRIPTS = Path(__file__).parent / "scripts"
TIMEOUT_S = 300  # only against a hang: four processes start torch on 2 shared cores


def _batch(step):
    """The data position is the step: batch i is a function of i alone."""
    return torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(10 + step))


def _boosted(plan, optimizer=torch.optim.AdamW):
    model = tiny_gpt2()
    return tessera.boost(model, optimizer(model.parameters(), lr=1e-2), plan)


ZERO3 = dict(dp=2, zero=3, chunk_mib=0.01)


def _train_with_checkpoints(folder, last, kill_in_write_at=None):
    """2 ranks, ZeRO-3: resume or start, train to ``last`` saving every 2 steps in the
    background; returns what every committed save held (copied when it was taken)."""
    model, opt = _boosted(tessera.Plan(**ZERO3))
    ckpt = tessera.train.resume_or_start(model, opt, folder, every=2, keep=2)
    first, taken = ckpt.step, {}
    for step in range(ckpt.step, last):
        opt.train_step(_batch(step), causal_lm_loss)
        if step + 1 == kill_in_write_at and torch.distributed.get_rank() == 1:

            class Killed(sc.FileSystemWriter):  # SIGKILL in the middle of DCP's write
                def write_data(self, plan, planner):
                    os.kill(os.getpid(), signal.SIGKILL)

            sc.FileSystemWriter = Killed
        if ckpt.maybe_save(step + 1):
            taken[step + 1] = full_state_dict(model, opt)
    ckpt.wait()
    return first, taken, full_state_dict(model, opt)


def _one_process(folder, **kwargs):
    model, opt = _boosted(tessera.Plan())
    return model, opt, tessera.train.resume_or_start(model, opt, folder, background=False, **kwargs)


def test_background_checkpoints_commit_prune_and_survive_a_kill_mid_write(tmp_path):
    folder = tmp_path / "ckpt"
    first, taken, final = spawn(_train_with_checkpoints, 2, str(folder), 6)[0]
    assert first == 0
    # keep=2: the newest two committed, nothing partial left
    assert [s for s, _ in resume.committed(folder)] == [4, 6]
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000004", "step-00000006"]
    # each holds the state of its step, though training went on while it was written
    model, opt, ckpt = _one_process(folder)
    assert ckpt.step == 6 and ckpt.resumed_from.name == "step-00000006"
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), taken[6][name], rtol=0, atol=0, msg=name)  # bit-exact
        torch.testing.assert_close(p.detach(), final[name], rtol=0, atol=0, msg=name)
    sc.load_sharded(model, opt, folder / "step-00000004")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), taken[4][name], rtol=0, atol=0, msg=name)

    # (b) rank 1 is SIGKILLed while it writes the step-8 checkpoint: step 6 stays the latest
    with pytest.raises(RankError, match="rank 1 failed: process exited with code -9"):
        spawn(_train_with_checkpoints, 2, str(folder), 10, 8)
    assert resume.latest(folder).name == "step-00000006"
    partial = folder / ".step-00000008.partial"
    assert partial.is_dir() and not (partial / "config.json").exists()
    model, opt, ckpt = _one_process(folder, every=2)
    assert ckpt.step == 6
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), taken[6][name], rtol=0, atol=0, msg=name)
    for step in range(6, 8):  # resumed in one process: the next commit clears the partial
        opt.train_step(_batch(step), causal_lm_loss)
    ckpt.save(8)
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000006", "step-00000008"]


def test_bad_checkpoint_directories_and_foreign_checkpoints_are_refused(tmp_path, monkeypatch):
    model, opt = _boosted(tessera.Plan())
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"checkpoint directory .*a-file/ckpt is not writable \(.*\)"):
        tessera.train.resume_or_start(model, opt, tmp_path / "a-file" / "ckpt")
    need = resume.checkpoint_bytes(model, opt)
    assert need == sum(p.numel() for p in model.parameters()) * 4 * 3  # fp32 weights + Adam's two
    monkeypatch.setattr(resume, "_free_bytes", lambda directory: need // 2)
    with pytest.raises(
        ValueError,
        match=rf"has {need / 2 / 2**20:.1f} MiB free; one checkpoint of this model and optimizer "
        rf"needs about {need / 2**20:.1f} MiB",
    ):
        tessera.train.resume_or_start(model, opt, tmp_path / "ckpt")
    monkeypatch.undo()
    ckpt = tessera.train.resume_or_start(model, opt, tmp_path / "ckpt", background=False)
    opt.train_step(_batch(0), causal_lm_loss)
    ckpt.save(1)
    wider = tiny_gpt2(width=64)
    wider, wider_opt = tessera.boost(wider, torch.optim.AdamW(wider.parameters()), tessera.Plan())
    with pytest.raises(
        CheckpointError, match=r"is from a different model: parameters differ at \['transformer"
    ):
        tessera.train.resume_or_start(wider, wider_opt, tmp_path / "ckpt")
    sgd, sgd_opt = _boosted(tessera.Plan(), optimizer=torch.optim.SGD)
    with pytest.raises(CheckpointError, match="holds AdamW state, but the optimizer is SGD"):
        tessera.train.resume_or_start(sgd, sgd_opt, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="keep must be at least 1"):
        tessera.train.resume_or_start(model, opt, tmp_path / "ckpt", keep=0)


def test_a_rank_killed_at_a_random_step_restarts_and_ends_bit_exactly(tmp_path):
    """(a) 2-rank ZeRO-3 under `tessera launch --max-restarts 1`: rank 1 is SIGKILLed after a
    random step; torchrun's agent restarts both ranks, which resume from the newest committed
    checkpoint by themselves; the final parameters equal an uninterrupted run's to the bit."""
    steps, kill_at = 12, random.randint(2, 11)
    folder = tmp_path / "ckpt"
    command = [sys.executable, "-m", "tessera.cli", "launch", "-n", "2", "--max-restarts", "1"]
    command += ["--checkpoint-dir", str(folder), "--checkpoint-every", "2"]
    command += [str(SCRIPTS / "elastic_train.py"), str(steps), str(kill_at)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"kill after step {kill_at}: {done.stderr[-3000:]}"
    assert json.loads((folder / "kill.json").read_text())["after_step"] == kill_at
    resumed = json.loads((folder / "restart.json").read_text())["from"]
    newest = (kill_at - 1) // 2 * 2  # the newest save before the kill; the one before if it was in flight
    assert resumed in (newest, max(0, newest - 2)), (kill_at, resumed)
    from safetensors.torch import load_file

    sys.path.insert(0, str(SCRIPTS))
    import elastic_train

    want = spawn(elastic_train.uninterrupted, 2, steps)[0]
    got = load_file(folder / "final.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=f"kill after {kill_at}: {name}")


HANG_TIMEOUT_S = 2  # the collective timeout under test; a hung peer sleeps past it


def _stop_calling_collectives(plan_kwargs, model_name, hung_rank):
    """Train with a short collective timeout; ``hung_rank`` stops calling collectives at the
    second step (it sleeps past the timeout, then leaves): the others must fail by name."""
    os.environ["TESSERA_COLLECTIVE_TIMEOUT_S"] = str(HANG_TIMEOUT_S)
    if model_name == "mlp":
        sys.path.insert(0, str(SCRIPTS))
        import elastic_train

        model, opt = elastic_train.build()
        loss_fn, batch = elastic_train.loss_fn, elastic_train.batch
    else:
        model, opt = _boosted(tessera.Plan(**plan_kwargs))
        loss_fn, batch = causal_lm_loss, _batch
    opt.train_step(batch(0), loss_fn)
    if torch.distributed.get_rank() == hung_rank:
        import time

        time.sleep(HANG_TIMEOUT_S + 4)
        return "hung"
    opt.train_step(batch(1), loss_fn)
    return "finished"


def test_a_rank_that_stops_calling_collectives_fails_its_peers_by_name():
    """(c) 2-rank ZeRO-3 (the MLP of scripts/elastic_train.py): rank 1 stops; rank 0 fails
    within the timeout with an error naming itself, the operation and the axis. (d) the same
    for pp2 x dp2 (GPT-2, 4 ranks): rank 3 stops; its dp peer, which finishes its own pipeline,
    fails in the gradient all-reduce over 'dp' (or a stage peer in the loss's over 'pp'). Fresh
    ranks: a hung group is never reused."""
    within = rf"did not complete within {HANG_TIMEOUT_S}s: a peer stopped calling collectives or died"
    with pytest.raises(RankError) as info:
        spawn(_stop_calling_collectives, 2, ZERO3, "mlp", 1, fresh=True, timeout_s=TIMEOUT_S)
    assert info.value.rank == 0
    assert "\n" not in info.value.message
    assert info.value.message.startswith("CollectiveError: rank 0: ")
    assert f"over mesh axis 'dp' (2 ranks) {within}" in info.value.message
    plan = dict(pp=2, dp=2, microbatches=2)
    with pytest.raises(RankError) as info:
        spawn(_stop_calling_collectives, 4, plan, "gpt2", 3, fresh=True, timeout_s=TIMEOUT_S)
    message = info.value.message
    assert info.value.rank != 3 and message.startswith(f"CollectiveError: rank {info.value.rank}: ")
    assert re.search(rf"all_reduce over mesh axis '(dp|pp)' \(2 ranks\) {within}", message), message


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-restarts", "2"], "--max-restarts 2 needs --checkpoint-dir: a restarted job resumes"),
        (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
        (["--checkpoint-dir", "{tmp}/ck", "--resume"], "--checkpoint-dir resumes by itself"),
        (["--checkpoint-dir", "{tmp}/a-file/ck"], r"checkpoint directory .*a-file/ck is not writable"),
    ],
)
def test_tessera_train_refuses_bad_checkpoint_flags_in_one_line(argv, message, tmp_path, capsys):
    from tessera.cli import main

    (tmp_path / "a-file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["train", "--recipe", "gpt2-text", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(message, err), err
    assert main(["train", "--recipe", "digits-dit", "--checkpoint-dir", str(tmp_path)]) == 2
    assert (
        "recipe digits-dit does not take --checkpoint-dir (they apply to gpt2-text)"
        in capsys.readouterr().err
    )
