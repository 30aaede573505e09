"""boost keeps the user's optimizer; BoostedOptimizer.state_dict() is the user's torch
optimizer's own state dict (whole, on every rank) under any plan, round-trips bit-exact and
loads across plans and into a plain torch optimizer; non-elementwise optimizers are refused
at ZeRO >= 1.

Tolerances: a plan sums the same gradients in another order than one process (dp
reductions, tp partial sums): fp32 rounding, ~1e-7 relative per step; Adam's moments after
3 steps of lr 1e-2 agree to rtol 1e-4 / atol 1e-6 (exp_avg_sq holds squares of ~1e-2
gradients, so 1e-6 absolute is far below its values); same-plan round trips are bit-exact.
"""

import copy

import pytest
import torch
from tiny_lm import SEQ, VOCAB, tiny_gpt2

import tessera
from tessera.runtime import spawn
from tessera.train.losses import causal_lm_loss

STEPS = 3


def _batches(n=STEPS + 1):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (8, SEQ), generator=g) for _ in range(n)]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.0)


def _reference():
    """One process, plain torch: the state after STEPS steps, and the weights after one more."""
    model = tiny_gpt2()
    opt = _adamw(model)
    states = []
    for batch in _batches():
        states.append(copy.deepcopy(opt.state_dict()))  # state_dict() shares the live tensors
        opt.zero_grad()
        causal_lm_loss(model, batch).backward()
        opt.step()
    return states[STEPS], {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_state_close(got, want, label, exact=False):
    assert got["state"].keys() == want["state"].keys(), label
    for i, entry in want["state"].items():
        assert got["state"][i].keys() == entry.keys(), (label, i)
        for key, value in entry.items():
            # the module docstring's: round trips bit-exact, across plans 1e-4 / 1e-6
            tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(got["state"][i][key], value, **tol, msg=f"{label} param {i} {key}")
    for g, w in zip(got["param_groups"], want["param_groups"], strict=True):
        assert {k: v for k, v in g.items() if k != "params"} == {
            k: v for k, v in w.items() if k not in ("params", "param_names")
        }, label


def _train_and_save(plan_kwargs):
    model = tiny_gpt2()
    model, opt = tessera.boost(model, _adamw(model), tessera.Plan(**plan_kwargs))
    for batch in _batches()[:STEPS]:
        opt.train_step(batch, causal_lm_loss)
    state = opt.state_dict()
    opt.load_state_dict(state)
    again = opt.state_dict()
    return state, again, len(opt.engine.groups)


def _worker(saved_ref_state):
    out = {}
    for label, kw in {
        "dp2 zero2 chunks": dict(dp=2, zero=2, chunk_mib=0.005),
        "dp2 zero3 checkpointed": dict(dp=2, zero=3, chunk_mib=0.005, activation_checkpointing=True),
        "tp2 zero1": dict(tp=2, zero=1),
    }.items():
        out[label] = _train_and_save(kw)
    # the reference's state, loaded into dp2 zero3 (sharded) beside weights it belongs to
    model = tiny_gpt2()
    model.load_state_dict(_reference_weights())
    model, opt = tessera.boost(model, _adamw(model), tessera.Plan(dp=2, zero=3, chunk_mib=0.005))
    opt.load_state_dict(saved_ref_state)
    opt.train_step(_batches()[STEPS], causal_lm_loss)
    from tessera.train.export import full_state_dict

    out["continued"] = full_state_dict(model, opt)
    return out


def _reference_weights():
    model = tiny_gpt2()
    opt = _adamw(model)
    for batch in _batches()[:STEPS]:
        opt.zero_grad()
        causal_lm_loss(model, batch).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_state_dict_is_the_torch_optimizers_under_every_plan_and_loads_across_plans():
    ref_state, ref_after = _reference()
    results = spawn(_worker, 2, ref_state)
    for rank, out in enumerate(results):
        for label in ("dp2 zero2 chunks", "dp2 zero3 checkpointed", "tp2 zero1"):
            state, again, chunks = out[label]
            if "chunks" in label:
                assert chunks >= 4, chunks  # several chunks on each rank, not one
            _assert_state_close(state, ref_state, f"rank {rank} {label}")
            _assert_state_close(again, state, f"rank {rank} {label} round trip", exact=True)
        # weights after one more AdamW step: the moments' 1e-4 (docstring) and 1e-5 absolute
        # for weights near zero, as test_boost_parity compares Adam-trained weights
        for name, ref in ref_after.items():
            torch.testing.assert_close(out["continued"][name], ref, rtol=1e-4, atol=1e-5, msg=name)
    # and the boosted state loads into a plain torch optimizer, which then steps the same
    state = results[0]["dp2 zero2 chunks"][0]
    model = tiny_gpt2()
    model.load_state_dict(_reference_weights())
    plain = _adamw(model)
    plain.load_state_dict(state)
    causal_lm_loss(model, _batches()[STEPS]).backward()
    plain.step()
    for name, p in model.named_parameters():  # as above
        torch.testing.assert_close(p.detach(), ref_after[name], rtol=1e-4, atol=1e-5, msg=name)


def test_boost_keeps_the_users_optimizer_its_settings_and_loaded_state():
    ref_state, _ = _reference()
    model = tiny_gpt2()
    model.load_state_dict(_reference_weights())
    user = torch.optim.AdamW(
        [
            {
                "params": [p for n, p in model.named_parameters() if n.endswith("bias")],
                "lr": 5e-3,
                "tag": "b",
            },
            {"params": [p for n, p in model.named_parameters() if not n.endswith("bias")]},
        ],
        lr=1e-2,
        eps=1e-4,
        weight_decay=0.0,
        amsgrad=True,
    )
    user.load_state_dict(_regroup(ref_state, model, user))
    loaded = user.state_dict()
    defaults = dict(user.defaults)
    model, opt = tessera.boost(model, user, tessera.Plan(zero=1, chunk_mib=0.005))
    assert opt.inner is user and user.defaults == defaults
    assert [g["lr"] for g in user.param_groups] == [5e-3, 1e-2] and user.param_groups[0]["tag"] == "b"
    assert all(g["amsgrad"] for g in user.param_groups)
    _assert_state_close(opt.state_dict(), loaded, "zero1 keeps the loaded state", exact=True)


def _regroup(state, model, user):
    """The reference state (one group, parameters in model order) numbered for ``user``'s groups."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    order = [index[id(p)] for g in user.param_groups for p in g["params"]]
    regrouped = {new: state["state"][old] for new, old in enumerate(order) if old in state["state"]}
    for entry in regrouped.values():  # amsgrad keeps one more moment
        entry["max_exp_avg_sq"] = entry["exp_avg_sq"].clone()
    return {"state": regrouped, "param_groups": user.state_dict()["param_groups"]}


def test_non_elementwise_optimizers_are_refused_at_zero_1_and_above():
    model = tiny_gpt2()
    with pytest.raises(
        ValueError, match=r"Plan\(zero=1\) steps flat shards .*Adafactor is not one: use Plan\(zero=0\)"
    ):
        tessera.boost(model, torch.optim.Adafactor(model.parameters()), tessera.Plan(zero=1))
    model, opt = tessera.boost(model, torch.optim.Adafactor(model.parameters()), tessera.Plan(zero=0))
    opt.train_step(_batches()[0], causal_lm_loss)  # at stage 0 any optimizer steps whole tensors
    assert isinstance(opt.inner, torch.optim.Adafactor)
