"""A running job never fails mid-step for lack of a placement: what one step needs at once
is checked at set-up (the dry run over the rank's real chunks) and measured in the
warm-up step, and a budget it does not fit is refused before the first optimizer step
with the numbers (tier, what was held at once, the budget), parameters unchanged. A
budget at the measured number runs, bit-exact with training in memory.

On 2 ranks a whole chunk is twice a shard, and the tied embedding's chunk stays whole
from lm_head's backward to the embedding's: the warm-up holds more at once than any one
chunk's use (what set-up can check), so budgets in between used to pass set-up and then
fail mid-step with TierFull."""

import dataclasses
import re

import torch
from offload_lm import CHUNK_MIB, batches, master_shards, model, optimizer, train

import tessera
from tessera.runtime import spawn
from tessera.train.losses import causal_lm_loss

# prefetch=0: what the warm-up measures is checked here; with prefetch=1 two whole chunks at
# once (41,920 bytes) are refused already at set-up (tests/train/test_zero_overlap.py)
PLAN = tessera.Plan(dp=2, zero=3, chunk_mib=CHUNK_MIB, max_grad_norm=0.5, prefetch=0)
# above what the largest chunk's use needs on 2 ranks (33,536 bytes: four 8,384-byte
# shards), below what the warm-up holds at once (58,304 bytes)
TIGHT = 40_000
ERROR = re.compile(
    r"Plan\.host_memory=40000 bytes: the warm-up step needed (\d+) bytes of chunks in use at once on the "
    r"host tier \(at .+\); refused before the first optimizer step \(parameters unchanged\): "
    r"raise Plan\.host_memory to at least \1 or lower Plan\.chunk_mib"
)


def _offload(budget, tmp):
    return dataclasses.replace(PLAN, offload="auto", host_memory=budget, offload_dir=str(tmp))


def _two_ranks(tmp):
    steps = batches()
    ref_losses, _, _, ref_opt = train(PLAN, steps)
    net = model()
    net, opt = tessera.boost(net, optimizer(net), _offload(TIGHT, tmp / "tight"))  # set-up passes
    before = master_shards(opt)
    try:
        opt.train_step(steps[0], causal_lm_loss)
        message = None
    except ValueError as e:
        message = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, master_shards(opt), strict=True))
    no_state = not any(opt.engine.optimizer.state.values())
    needed = int(ERROR.fullmatch(message).group(1)) if message and ERROR.fullmatch(message) else None
    runs_exact = False
    if needed is not None:  # the number the refusal names is enough: three steps run, bit-exact
        ok_losses, _, _, ok_opt = train(_offload(needed, tmp / "ok"), steps)
        same = [torch.equal(a, b) for a, b in zip(master_shards(ok_opt), master_shards(ref_opt), strict=True)]
        runs_exact = ok_losses == ref_losses and all(same)
    return message, unchanged, no_state, needed, runs_exact


def test_a_budget_the_warm_up_does_not_fit_is_refused_before_any_step(tmp_path):
    for message, unchanged, no_state, needed, runs_exact in spawn(_two_ranks, 2, tmp_path, timeout_s=300):
        assert message is not None and "\n" not in message and ERROR.fullmatch(message), message
        assert needed > TIGHT
        assert unchanged and no_state  # refused before the optimizer stepped anything
        assert runs_exact
