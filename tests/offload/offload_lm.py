"""The tiny model, batches and run loop the offload tests share."""

import sys
from pathlib import Path

import torch
from torch import nn

import tessera
from tessera.train.losses import causal_lm_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from tiny_lm import SEQ, VOCAB, tiny_gpt2  # noqa: E402

STEPS = 3
BATCH = 8
# 0.016 MiB = 4194 fp32 elements: just above the largest parameter (the tied 128 x 32 token
# embedding), so the tiny GPT-2 splits into 11 chunks (two blocks of ~12.6k elements each)
CHUNK_MIB = 0.016
# 120 kB of host memory for ~52k elements (208 kB) of parameters, their gradients and two
# Adam moments (4 x 208 kB in all): every kind of chunk is evicted and fetched every step
HOST_MEMORY = 120_000


def model() -> nn.Module:
    m = tiny_gpt2()  # lm_head tied to the token embedding
    m.unused = nn.Linear(4, 4)  # a parameter no step uses
    return m


def batches(seed: int = 3, n: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(n)]


def optimizer(m: nn.Module, **kw) -> torch.optim.Optimizer:
    # eps 1e-4: some true gradients are exactly zero (see tests/train/test_boost_parity.py)
    return torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.0, **kw)


def train(plan: tessera.Plan, steps: list[torch.Tensor], **opt_kw):
    """(losses, per-step move counters or None, boosted model and optimizer)."""
    m = model()
    m, opt = tessera.boost(m, optimizer(m, **opt_kw), plan)
    losses, moves = [], []
    for batch in steps:
        losses.append(opt.train_step(batch, causal_lm_loss)["loss"])
        if opt.engine.offload is not None:
            # the host tier's peak so far: before any check brings every chunk in at once
            moves.append({**opt.engine.offload.moved(), "peak": opt.engine.offload.store.tiers[0].peak})
    return losses, moves or None, m, opt


def master_shards(opt) -> list[torch.Tensor]:
    """The rank's fp32 master shards, copied while every chunk is in fast memory."""
    with opt.engine.resident():
        return [s.detach().clone() for s in opt.engine.shards]


def adam_states(opt) -> list[torch.Tensor]:
    with opt.engine.resident():
        state = opt.engine.optimizer.state
        return [state[s][k].clone() for s in opt.engine.shards for k in ("exp_avg", "exp_avg_sq")]
