"""A crash in the middle of saving an offloaded run leaves the previous checkpoint whole
(it still loads bit-exact) and the run itself consistent (its next step is bit-identical
to a run that never tried to save). Three crashes, each forced: a disk read failing
while the chunks are brought into memory for the save, an error while the pieces are
being collected (every chunk resident), and the shard file's write failing halfway."""

import dataclasses

import pytest
import torch
from offload_lm import CHUNK_MIB, HOST_MEMORY, batches, master_shards, model, optimizer, train

import tessera
import tessera.train.checkpoint_boxes as boxes
import tessera.train.sharded_checkpoint as sharded
from tessera.memory.tiers import DiskTier
from tessera.train.losses import causal_lm_loss

PLAN = tessera.Plan(zero=3, chunk_mib=CHUNK_MIB, max_grad_norm=0.5)
STEPS = 6  # 2, the good save, 3 steps each after a crashed save, 1 after loading


def _fail_after(n, real, error):
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] > n:
            raise error
        return real(*args, **kwargs)

    return wrapped


class _DiskFull(sharded.FileSystemWriter):
    """torch.distributed.checkpoint's writer that leaves a half-written data file and fails."""

    def write_data(self, plan, planner):
        with open(f"{self.path}/__0_0.distcp", "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError("disk full (forced)")


def test_a_crash_mid_save_keeps_the_previous_checkpoint_and_the_run(tmp_path, monkeypatch):
    steps = batches(n=STEPS)
    ref_losses, _, _, ref_opt = train(PLAN, steps)  # in memory, never stopped
    offloaded = dataclasses.replace(
        PLAN, offload="auto", host_memory=HOST_MEMORY, offload_dir=str(tmp_path / "o")
    )
    m = model()
    m, opt = tessera.boost(m, optimizer(m), offloaded)
    losses = [opt.train_step(b, causal_lm_loss)["loss"] for b in steps[:2]]
    ckpt = tmp_path / "ckpt"
    sharded.save_sharded(m, opt, ckpt)
    crashes = [
        (DiskTier, "read_into", _fail_after(3, DiskTier.read_into, OSError("read failed (forced)"))),
        (boxes, "tp_layout", _fail_after(5, boxes.tp_layout, RuntimeError("crash (forced)"))),
        (sharded, "FileSystemWriter", _DiskFull),
    ]
    for (owner, name, replacement), batch in zip(crashes, steps[2:5], strict=True):
        losses.append(opt.train_step(batch, causal_lm_loss)["loss"])
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, replacement)
            with pytest.raises((OSError, RuntimeError), match="forced"):
                sharded.save_sharded(m, opt, ckpt)
        assert opt.engine.offload.store.tiers[0].used <= HOST_MEMORY  # back within the budget
    # the run went on as if no save had been tried
    assert losses == ref_losses[:5], (losses, ref_losses)
    # the checkpoint of step 2 is whole: loaded in memory, its next step is the reference's third
    fresh = model()
    fresh, fresh_opt = tessera.boost(fresh, optimizer(fresh), PLAN)
    sharded.load_sharded(fresh, fresh_opt, ckpt)
    assert fresh_opt.train_step(steps[2], causal_lm_loss)["loss"] == ref_losses[2]
    _, _, _, ref3 = train(PLAN, steps[:3])
    for a, b in zip(master_shards(fresh_opt), master_shards(ref3), strict=True):
        assert torch.equal(a, b)
    assert not (tmp_path / ".ckpt.old").exists()
