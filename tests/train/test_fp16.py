"""Plan(precision="fp16"): dynamic loss scaling as torch.amp.GradScaler does it, over ZeRO
shards on several ranks.

One process: the boosted run (ZeRO 0 and 3) and a plain torch run with GradScaler under fp16
autocast, same initial scale and growth interval, take the same sequence of scales and the
same skipped (overflowing) steps, and end at the same weights. Two ranks: an overflow in one
element of one rank's gradient is seen by the rank that owns that shard only; the ranks
agree on it, so both skip and keep the same scale.

Tolerances: the forward and backward are the same ops on the same numbers (bit-equal
losses and overflow decisions); the boosted optimizer steps flat fp32 shards where torch
steps each tensor (rounding of the same elementwise formula, ~1e-7 relative per step),
so weights after 8 Adam steps of lr 1e-2 agree to rtol 1e-4 / atol 1e-5.
"""

import torch
from tiny_lm import SEQ, VOCAB, tiny_llama

import tessera
from tessera.runtime import spawn
from tessera.train.export import full_state_dict
from tessera.train.losses import causal_lm_loss

INIT_SCALE = 2.0**20  # measured: overflows on steps 2, 5 and 8 of these batches
LOW_SCALE = 2.0**12  # far from overflowing on its own
GROWTH_INTERVAL = 2
STEPS = 8


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (8, SEQ), generator=g) for _ in range(STEPS)]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.0)


def _reference():
    model = tiny_llama()
    opt = _adamw(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    scales, skipped, losses = [], [], []
    for batch in _batches():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = causal_lm_loss(model, batch)
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scales[-1])  # an overflow halves the scale
        losses.append(loss.item())
    return scales, skipped, losses, dict(model.named_parameters())


def _boosted(plan_kwargs, init_scale=INIT_SCALE):
    model = tiny_llama()
    plan = tessera.Plan(
        precision="fp16",
        loss_scale_init=init_scale,
        loss_scale_growth_interval=GROWTH_INTERVAL,
        **plan_kwargs,
    )
    return tessera.boost(model, _adamw(model), plan)


def test_loss_scaling_follows_grad_scaler_on_one_process():
    ref_scales, ref_skipped, ref_losses, ref_params = _reference()
    assert any(ref_skipped) and not all(ref_skipped)  # the run has overflows and clean steps
    for plan_kwargs in (dict(zero=0), dict(zero=3, chunk_mib=0.005)):
        model, opt = _boosted(plan_kwargs)
        stats = [opt.train_step(batch, causal_lm_loss) for batch in _batches()]
        assert [s["loss_scale"] for s in stats] == ref_scales, plan_kwargs
        assert [s["skipped"] for s in stats] == ref_skipped, plan_kwargs
        assert stats[-1]["skipped_steps"] == sum(ref_skipped) == opt.skipped_steps
        # assert_close's fp32 default (rtol 1.3e-6, atol 1e-5): the first loss is bit-equal,
        # later ones see weights that differ by the optimizer's rounding (~1e-7 relative a step)
        torch.testing.assert_close(torch.tensor([s["loss"] for s in stats]), torch.tensor(ref_losses))
        params = full_state_dict(model, opt)  # ZeRO-3 keeps only shards: gather them
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref.detach(), rtol=1e-4, atol=1e-5, msg=name)
        state = opt.state_dict()["loss_scaler"]
        assert state["scale"] == ref_scales[-1] * (0.5 if ref_skipped[-1] else 1.0)


def _one_rank_overflows():
    rank = torch.distributed.get_rank()
    poison = {"on": False}

    def loss_fn(model, batch):
        loss = causal_lm_loss(model, batch)
        if poison["on"] and rank == 1:  # one element's gradient overflows, on rank 1 only
            loss = loss + model.model.norm.weight[3] * 1e35
        return loss

    model, opt = _boosted(dict(dp=2, zero=2, chunk_mib=0.005), init_scale=LOW_SCALE)
    batches = _batches()
    clean = opt.train_step(batches[0], loss_fn)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    poison["on"] = True
    poisoned = opt.train_step(batches[1], loss_fn)
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    poison["on"] = False
    after = opt.train_step(batches[2], loss_fn)
    return clean, poisoned, after, unchanged


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    for clean, poisoned, after, unchanged in spawn(_one_rank_overflows, 2):
        assert not clean["skipped"] and poisoned["skipped"] and not after["skipped"]
        assert unchanged  # no shard stepped
        assert poisoned["loss_scale"] == clean["loss_scale"] == LOW_SCALE
        assert after["loss_scale"] == LOW_SCALE / 2 and after["skipped_steps"] == 1
