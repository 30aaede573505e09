"""A 2-rank ZeRO-3 training run for the chaos tests and the recovery benchmark, run under
`tessera launch --max-restarts 1 --checkpoint-dir DIR --checkpoint-every 2`:

    elastic_train.py STEPS [KILL_AT]

On the first attempt rank 1 SIGKILLs itself right after step KILL_AT (before that step's
checkpoint), and writes the moment to DIR/kill.json; torchrun's agent restarts both ranks,
which resume from the newest committed checkpoint. Rank 0 writes the final parameters to
DIR/final.safetensors and, after a restart, the moment its first step ended to
DIR/restart.json. A tiny MLP (no transformers import: a restart costs process start-up and
torch's import, which is what a real job pays too)."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import tessera
from tessera.train.export import full_state_dict

PLAN = dict(dp=2, zero=3, chunk_mib=0.001)


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    return tessera.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2), tessera.Plan(**PLAN))


def batch(step: int):
    """Batch ``step`` is a function of the step alone: the data position is the step."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def uninterrupted(steps: int) -> dict:
    """The reference: the same training with no checkpoint and no kill (under spawn)."""
    model, opt = build()
    for step in range(steps):
        opt.train_step(batch(step), loss_fn)
    return full_state_dict(model, opt)


def main() -> None:
    from safetensors.torch import save_file

    from tessera.runtime import init_from_env

    steps = int(sys.argv[1])
    kill_at = int(sys.argv[2]) if len(sys.argv) > 2 else None
    init_from_env(timeout_s=60)
    rank = torch.distributed.get_rank()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model, opt = build()
    ckpt = tessera.train.resume_or_start(model, opt)  # the directory and interval from tessera launch
    folder = ckpt.directory
    for step in range(ckpt.step, steps):
        opt.train_step(batch(step), loss_fn)
        if attempt > 0 and rank == 0 and step == ckpt.step:
            (folder / "restart.json").write_text(
                json.dumps({"first_step_done": time.time(), "from": ckpt.step})
            )
        if attempt == 0 and rank == 1 and step + 1 == kill_at:
            (folder / "kill.json").write_text(json.dumps({"killed": time.time(), "after_step": kill_at}))
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.maybe_save(step + 1)
    ckpt.wait()
    final = full_state_dict(model, opt)
    if rank == 0:
        save_file(final, str(Path(folder) / "final.safetensors"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
