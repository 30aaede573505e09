"""Every transformers family in tiny_families.FAMILIES, trained under the plan it ships
(config.base_model_tp_plan, applied with DTensor), against single-process training: the same
3 AdamW steps from the same weights on the same global batches at dp2 ZeRO-3, tp2 and
dp2 x tp2 (ZeRO-3). One spawned group per world size covers every family.

Tolerances (as in test_boost_parity): parallel runs sum the same gradients in another order
(a dp reduce-scatter, tp partial sums of row-parallel outputs and vocabulary-parallel
embeddings), fp32 rounding of ~1e-7 relative per step. Adam divides by sqrt(v), so an element
whose gradient is near zero can turn a rounding difference into a visible one (hence eps
1e-4): parameters are compared with rtol 1e-4 / atol 1e-4 after 3 steps at lr 1e-2, losses
with rtol 1e-5 / atol 1e-6. Why atol 1e-4: where |g| << eps, Adam's first step is lr * g / eps,
100 x g here, and a gradient element that is a sum of ~100 terms of ~1e-2 cancelling to
nearly zero (an embedding row tied to the head, for a token that occurs once) carries fp32
rounding of up to ~1e-6 absolute; measured: OLMo-2's embedding row 42 (gradient 7.6e-7 on
step 3) ended 3.4e-5 from one process under tp2 on one machine and within 1e-5 on another.
1e-4 is still 100 x below one lr-sized step, so a wrong gradient cannot pass.
"""

import torch
from tiny_families import FAMILIES, SEQ, VOCAB, tiny_family

import tessera
from tessera.parallel.tp_plans import TPPlan, apply_tp, plan_for
from tessera.runtime import spawn
from tessera.train.export import full_state_dict
from tessera.train.losses import causal_lm_loss

PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-4  # see the module docstring
STEPS, GLOBAL_BATCH = 3, 8
PLANS = {
    "dp2_zero3": dict(dp=2, zero=3, chunk_mib=0.01),  # several chunks per rank
    "tp2": dict(tp=2),
    "dp2_tp2_zero3": dict(dp=2, tp=2, zero=3, chunk_mib=0.01),
}


def _aliases_plan(model) -> TPPlan:
    """LLaMA's plan with the other supported names: the embedding split on its width, the
    MLP gathered whole after gate/up and split again (locally) before down."""
    layers = dict(plan_for(model).layers)
    layers["model.embed_tokens"] = "embedding_colwise"
    layers |= {f"model.layers.*.mlp.{p}_proj": "colwise_rep" for p in ("gate", "up")}
    layers["model.layers.*.mlp.down_proj"] = "rowwise_rep"
    return TPPlan(family="llama_aliases", layers=layers)


CUSTOM = {"llama_aliases": ("llama", _aliases_plan)}  # label -> (family, plan)


def _build(label: str):
    family, make_plan = CUSTOM.get(label, (label, None))
    model = tiny_family(family)
    return model, (make_plan(model) if make_plan else None)


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _optimizer(model):
    # eps 1e-4, not 1e-8: some elements' true gradient is exactly zero (attention ignores the
    # key bias), and Adam would turn their rounding noise (~1e-10) into lr-sized steps.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.0)


def _params(model, optimizer=None) -> dict[str, torch.Tensor]:
    state = full_state_dict(model, optimizer)
    return {n: state[n] for n, _ in model.named_parameters()}


def reference(label: str):
    model, _ = _build(label)
    opt, losses = _optimizer(model), []
    for batch in _batches():
        opt.zero_grad()
        loss = causal_lm_loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, _params(model)


def _worker(runs):
    results = []
    for label, plan_name in runs:
        model, tp_plan = _build(label)
        model, opt = tessera.boost(
            model, _optimizer(model), tessera.Plan(**PLANS[plan_name]), tp_plan=tp_plan
        )
        losses = [opt.train_step(batch, causal_lm_loss)["loss"] for batch in _batches()]
        comm = opt.mesh.comm.ledger.snapshot()
        split = sum(any(pl.is_shard() for pl in getattr(p, "placements", ())) for p in model.parameters())
        results.append((losses, _params(model, opt), comm, split))
    return results


def _check(runs, rank_results):
    references = {label: reference(label) for label in dict(runs)}
    for results in rank_results:  # every rank holds the same whole parameters
        for (label, plan_name), (losses, params, comm, split) in zip(runs, results, strict=True):
            what = f"{label} {plan_name}"
            assert (split > 0) == ("tp" in PLANS[plan_name]), (what, split)  # DTensor shards held
            for axis in ("dp", "tp"):  # every split axis moved bytes (tp: DTensor's collectives)
                moved = sum(v["bytes"] for k, v in comm.items() if k.endswith("@" + axis))
                assert (moved > 0) == (PLANS[plan_name].get(axis, 1) > 1), (what, comm)
            ref_losses, ref_params = references[label]
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=what
            )
            assert params.keys() == ref_params.keys(), what
            for name, ref in ref_params.items():
                torch.testing.assert_close(
                    params[name],
                    ref,
                    rtol=PARAM_RTOL,
                    atol=PARAM_ATOL,
                    msg=lambda m, n=name, w=what: f"{w} {n}: {m}",
                )
    for label, (_, trained) in references.items():  # each reference trained
        start = _params(_build(label)[0])
        assert sum(not torch.equal(trained[n], start[n]) for n in start) > len(start) // 2, label


def _two_rank_worker(runs):
    return _worker(runs), _tie_split_differently()


def test_every_family_at_dp2_zero3_and_tp2_on_two_ranks():
    """Also: a tie whose two uses would be split differently is refused by name."""
    runs = [(f, p) for p in ("dp2_zero3", "tp2") for f in FAMILIES] + [("llama_aliases", "tp2")]
    (results, message), (other, _) = spawn(_two_rank_worker, 2, runs, timeout_s=600)
    assert message is not None and "tied parameter" in message and "equal splits" in message, message
    _check(runs, [results, other])


def test_every_family_at_dp2_x_tp2_on_four_ranks():
    runs = [(f, "dp2_tp2_zero3") for f in FAMILIES]
    _check(runs, spawn(_worker, 4, runs, timeout_s=600))


def _tie_split_differently():
    model = tiny_family("gemma")  # the head is tied to the embedding
    plan = plan_for(model)
    plan = TPPlan(family="gemma", layers={**plan.layers, "model.embed_tokens": "embedding_colwise"})
    mesh = tessera.runtime.Mesh(tp=2)
    try:
        apply_tp(model, plan, mesh.device_mesh["tp"], 2)
    except ValueError as error:
        return str(error)
    return None
