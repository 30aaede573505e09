"""Plan validation and the clear errors boost and the tensor parallel plans give."""

import pytest
import torch
from tiny_lm import tiny_llama

import tessera
from tessera.parallel.tp_plans import TPPlan, apply_tp, plan_for

LLAMA = plan_for(tiny_llama(layers=1))  # transformers' own plan (config.base_model_tp_plan)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dp=0), "Plan.dp must be a positive integer, got 0"),
        (dict(tp=1.5), "Plan.tp must be a positive integer, got 1.5"),
        (dict(zero=4), "Plan.zero must be 0, 1, 2 or 3, got 4"),
        (dict(precision="fp8"), "Plan.precision must be one of"),
        (dict(block_chunks=1), "Plan.block_chunks must be True or False, got 1"),
        (dict(loss_scale_init=0.0), "Plan.loss_scale_init must be > 0, got 0.0"),
        (dict(grad_accum=0), "Plan.grad_accum must be a positive integer"),
        (dict(max_grad_norm=-1.0), "Plan.max_grad_norm must be > 0 or None, got -1.0"),
    ],
)
def test_bad_plans_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tessera.Plan(**kwargs)


def _llama(vocab=128):
    return tiny_llama(layers=1, vocab=vocab)


def test_plan_whose_product_is_not_the_world_size():
    model = _llama()
    with pytest.raises(ValueError, match=r"Plan dp=2 x tp=2 = 4 processes, but the world has 1"):
        tessera.boost(model, torch.optim.AdamW(model.parameters()), tessera.Plan(dp=2, tp=2))


def test_tp_degree_must_divide_heads_hidden_and_vocabulary():
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_key_value_heads=2 of LlamaForCausalLM"):
        apply_tp(_llama(), LLAMA, None, 4)
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4 of LlamaForCausalLM"):
        apply_tp(_llama(), LLAMA, None, 3)
    with pytest.raises(
        ValueError, match=r"tp=2 does not divide the vocabulary \(127\) of module 'model.embed_tokens'"
    ):
        apply_tp(_llama(vocab=127), LLAMA, None, 2)


def test_plan_pattern_matching_nothing_and_unknown_model():
    bad = TPPlan(family="llama", layers={**LLAMA.layers, "model.layers.*.self_attn.qkv": "colwise"})
    with pytest.raises(
        ValueError, match=r"pattern 'model.layers.\*.self_attn.qkv' matches no module of LlamaForCausalLM"
    ):
        apply_tp(_llama(), bad, None, 2)
    with pytest.raises(ValueError, match=r"no tensor parallel plan for Sequential; plans exist for"):
        plan_for(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_optimizer_must_hold_the_models_parameters():
    model = _llama()
    stray = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="the optimizer holds 1 tensor"):
        tessera.boost(model, torch.optim.SGD([*model.parameters(), stray], lr=0.1), tessera.Plan())


def test_bf16_plan_runs_the_forward_under_autocast_with_fp32_master_weights():
    model = _llama()
    model, opt = tessera.boost(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), tessera.Plan(precision="bf16")
    )
    seen = {}

    def loss_fn(m, tokens):
        logits = m(input_ids=tokens).logits
        seen["logits"] = logits.dtype
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 128), tokens.reshape(-1))

    stats = opt.train_step(torch.randint(0, 128, (4, 8)), loss_fn)
    assert seen["logits"] == torch.bfloat16 and stats["loss"] > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32


def test_an_lr_scheduler_drives_the_inner_optimizer():
    model = _llama()
    model, opt = tessera.boost(model, torch.optim.SGD(model.parameters(), lr=0.5), tessera.Plan(zero=1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt.inner, lambda step: 0.0 if step >= 1 else 1.0)
    tokens = torch.randint(0, 128, (2, 8))
    from tessera.train.losses import causal_lm_loss

    opt.train_step(tokens, causal_lm_loss)
    sched.step()  # lr -> 0: the next step must leave the weights alone
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.train_step(tokens, causal_lm_loss)
    assert opt.param_groups[0]["lr"] == 0.0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_num_microbatches_is_the_old_name_with_a_warning():
    from tessera import Plan

    plan = Plan(pp=2, microbatches=4)
    with pytest.warns(FutureWarning, match="Plan.num_microbatches is renamed Plan.microbatches"):
        assert plan.num_microbatches == 4
