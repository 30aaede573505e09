"""tessera.boost with pipeline (``Plan(pp=...)``) and sequence parallel (``Plan(sp=...)``)
plans, composed with dp, tp and ZeRO, against one process training on the whole batch: the
same losses every step and the same parameters after 3 steps, from the same weights.

Plain SGD (lr 0.5) runs most cases: a parameter moves by exactly lr x gradient, so a
gradient summed instead of averaged, a missed tied gradient or a wrong clip coefficient
moves it by ~1e-3 or more. Clipping (max_grad_norm 0.5, below the gradients' norm ~1-3 here)
is on in several cases, so the global norm over stages / ranks is exercised.

Tolerances: parallel runs sum the same gradients in another order (micro-batches averaged
instead of one batch, dp all-reduce, ring attention's log-sum-exp merge, tp partial sums):
fp32 rounding, measured <= 1e-6 relative per step; parameters are compared with rtol 1e-4 /
atol 1e-5 after 3 steps and losses with rtol 1e-5. The bf16 case runs the stages under bf16
autocast as the reference does; bf16 keeps 8 bits of mantissa and the micro-batch split
changes which products are rounded, so its tolerance is 2e-2 relative (a sign or factor-2
error in a gradient is far larger than that).
"""

import pytest
import torch
from tiny_lm import SEQ, VOCAB, tiny_gpt2, tiny_llama

import tessera
from tessera.runtime import spawn
from tessera.train.losses import causal_lm_loss, mse_loss

STEPS, BATCH = 3, 8


def _model(family: str, layers: int):
    if family == "dit":
        from tessera.models.dit import DiT, DiTConfig

        torch.manual_seed(0)
        return DiT(DiTConfig(image_size=8, patch_size=2, hidden_size=32, depth=layers, num_heads=4))
    if family == "gpt2":
        model = tiny_gpt2()  # head tied to the token embedding, 2 layers
        if layers != 2:
            from transformers import GPT2LMHeadModel

            torch.manual_seed(0)
            cfg = model.config
            cfg.n_layer = layers
            model = GPT2LMHeadModel(cfg)
        return model
    return tiny_llama(layers=layers)


def _batches(family: str = "llama"):
    g = torch.Generator().manual_seed(3)
    if family == "dit":  # (x_t, t, y, target velocity)
        return [
            (
                torch.randn(BATCH, 1, 8, 8, generator=g),
                torch.rand(BATCH, generator=g),
                torch.randint(0, 10, (BATCH,), generator=g),
                torch.randn(BATCH, 1, 8, 8, generator=g),
            )
            for _ in range(STEPS)
        ]
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _loss(family: str):
    return mse_loss if family == "dit" else causal_lm_loss


def _optimizer(model, kind: str):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.0)


def reference(family, layers, kind, max_norm=None, precision="fp32"):
    model = _model(family, layers)
    opt = _optimizer(model, kind)
    losses, norms = [], []
    for batch in _batches(family):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = _loss(family)(model, batch)
        loss.backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _stage_params(opt) -> list:
    """The parameters this rank trains (a pipelined rank: its stages'; at ZeRO-1 its
    optimizer steps a share and receives the rest)."""
    if hasattr(opt, "stepped_parameters"):
        return opt.stepped_parameters
    return [p for group in opt.param_groups for p in group["params"]]


def _worker(cases):
    out = []
    for family, layers, kind, plan_kwargs in cases:
        model = _model(family, layers)
        model, opt = tessera.boost(model, _optimizer(model, kind), tessera.Plan(**plan_kwargs))
        stats = [opt.train_step(batch, _loss(family)) for batch in _batches(family)]
        losses, norms = [s["loss"] for s in stats], [s["grad_norm"] for s in stats]
        held = {}
        stepped = {id(p) for p in _stage_params(opt)}
        for name, p in model.named_parameters():
            if id(p) not in stepped:  # another pipeline stage's parameter
                continue
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            held[name] = full.detach().clone()
        if not hasattr(opt, "trainer"):  # not pipelined: ZeRO keeps the parameters in its chunks
            from tessera.train.export import full_state_dict

            state = full_state_dict(model, opt)
            held = {n: state[n] for n, _ in model.named_parameters()}
        out.append((losses, norms, held))
    return out


def _check(cases, results):
    for i, (family, layers, kind, plan_kwargs) in enumerate(cases):
        bf16 = plan_kwargs.get("precision") == "bf16"
        # parameters: see the module docstring; atol is the floor for elements near zero, where a
        # relative bound means nothing (bf16: a tenth of its 2e-2, on weights of size ~0.02-1)
        rtol, atol = (2e-2, 2e-3) if bf16 else (1e-4, 1e-5)
        ref_losses, ref_norms, ref_params = reference(
            family, layers, kind, plan_kwargs.get("max_grad_norm"), plan_kwargs.get("precision", "fp32")
        )
        covered = set()
        for losses, norms, held in (r[i] for r in results):
            torch.testing.assert_close(
                torch.tensor(losses),
                torch.tensor(ref_losses),
                rtol=1e-5 if not bf16 else 2e-2,
                atol=0,
                msg=lambda m, said=f"{plan_kwargs}: {losses} vs {ref_losses}": f"{said}\n{m}",
            )
            if ref_norms:  # the global norm every rank reports: each gradient once, over all ranks
                torch.testing.assert_close(
                    torch.tensor(norms, dtype=torch.float64),
                    torch.tensor(ref_norms, dtype=torch.float64),
                    rtol=1e-5 if not bf16 else 2e-2,  # the same gradients, summed in another order
                    atol=0,
                    msg=lambda m, said=f"{plan_kwargs}: norms {norms} vs {ref_norms}": f"{said}\n{m}",
                )
            for name, value in held.items():
                torch.testing.assert_close(
                    value,
                    ref_params[name],
                    rtol=rtol,
                    atol=atol,
                    msg=lambda m, said=f"{plan_kwargs} {name}": f"{said}\n{m}",
                )
                covered.add(name)
        assert covered == set(ref_params), f"{plan_kwargs}: no rank holds {set(ref_params) - covered}"


CASES_2 = [
    ("gpt2", 2, "sgd", dict(dp=1, pp=2, schedule="gpipe", microbatches=2, max_grad_norm=0.5)),
    ("llama", 3, "sgd", dict(dp=1, pp=2, schedule="1f1b", microbatches=4)),  # 3 layers over 2 stages
    ("gpt2", 4, "adamw", dict(dp=1, pp=2, schedule="interleaved", virtual_stages=2, microbatches=2)),
    ("llama", 2, "sgd", dict(dp=1, pp=2, microbatches=2, precision="bf16", activation_checkpointing=True)),
    ("llama", 3, "sgd", dict(dp=1, pp=2, stage_layers="balanced", microbatches=2)),
    ("dit", 3, "sgd", dict(dp=1, pp=2, microbatches=2, max_grad_norm=0.5)),  # (x_t, t, y) through stages
    ("llama", 2, "sgd", dict(dp=1, sp=2, sp_method="ring", max_grad_norm=0.5)),
    ("llama", 2, "adamw", dict(dp=1, sp=2, sp_method="ulysses", grad_accum=2)),
    ("llama", 2, "sgd", dict(dp=1, sp=2, precision="bf16", activation_checkpointing=True)),
]
CASES_4 = [
    ("gpt2", 2, "sgd", dict(dp=2, pp=2, microbatches=2, max_grad_norm=0.5)),
    ("llama", 3, "adamw", dict(dp=2, pp=2, zero=1, microbatches=2, max_grad_norm=0.5)),
    ("llama", 2, "sgd", dict(dp=1, pp=2, tp=2, schedule="gpipe", microbatches=2, max_grad_norm=0.5)),
    ("llama", 2, "sgd", dict(dp=2, sp=2, zero=1, sp_method="ring", chunk_mib=0.01, max_grad_norm=0.5)),
    ("llama", 2, "adamw", dict(dp=2, sp=2, zero=3, sp_method="ulysses", chunk_mib=0.01)),
    ("llama", 2, "sgd", dict(dp=1, sp=2, tp=2, sp_method="ring", max_grad_norm=0.5)),
    ("llama", 2, "sgd", dict(dp=1, pp=2, sp=2, sp_method="ring", microbatches=2, max_grad_norm=0.5)),
    ("gpt2", 2, "sgd", dict(dp=1, pp=2, sp=2, sp_method="ulysses", microbatches=2)),  # tied head
]
CASES_SP_NORMS = [
    ("llama", 2, "sgd", dict(dp=1, tp=2, sequence_parallel_norms=True, max_grad_norm=0.5)),
    ("llama", 2, "adamw", dict(dp=1, tp=2, zero=1, sequence_parallel_norms=True, chunk_mib=0.01)),
]
CASES_8 = [
    ("llama", 2, "sgd", dict(dp=2, pp=2, tp=2, microbatches=2, max_grad_norm=0.5)),
    ("llama", 2, "adamw", dict(dp=2, pp=2, sp=2, zero=1, microbatches=2)),
]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4), (8, CASES_8)], ids=["2", "4", "8"])
def test_pipeline_and_sequence_plans_equal_one_process(world, cases):
    _check(cases, spawn(_worker, world, cases, timeout_s=600))


def _uneven_batch_worker():
    model = tiny_gpt2()
    model, opt = tessera.boost(model, _optimizer(model, "sgd"), tessera.Plan(pp=2, microbatches=3))
    try:
        opt.train_step(_batches()[0], causal_lm_loss)
    except ValueError as exc:
        return str(exc)
    return None


def test_microbatches_that_do_not_divide_the_batch_are_refused():
    message = spawn(_uneven_batch_worker, 2)[0]
    assert message is not None and "global batch of 8 does not split into dp=1 x microbatches=3" in message


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pp=2, zero=2), r"Plan\(pp=2\) with zero=2 is not supported .*use zero=1"),
        (dict(pp=2, grad_accum=2), r"grad_accum=2 .*raise microbatches"),
        (dict(microbatches=4), r"Plan.microbatches=4 needs pipeline stages"),
        (dict(pp=2, microbatches=1), r"needs at least pp=2 micro-batches, got microbatches=1"),
        (dict(pp=2, virtual_stages=2), r"virtual_stages=2 needs schedule='interleaved'"),
        (
            dict(pp=2, stage_layers=(1, 1, 1)),
            r"stage_layers must be .balanced. or a tuple of 2 positive layer counts",
        ),
        (dict(pp=2, schedule="zigzag"), r"Plan.schedule must be one of"),
        (dict(sp=2, sp_method="stripes"), r"Plan.sp_method must be one of"),
        (dict(sp=2, zero=3, offload="auto"), r"Plan\(sp=2\) with offload='auto' is not supported yet"),
        (dict(sequence_parallel_norms=True), r"it needs tp > 1 \(got tp=1\)"),
    ],
)
def test_bad_pipeline_and_sequence_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tessera.Plan(**kwargs)


def test_world_size_counts_every_axis():
    plan = tessera.Plan(dp=2, pp=2, tp=2)
    assert plan.world_size == 8
    with pytest.raises(ValueError, match=r"Plan dp=2 x pp=2 x tp=2 = 8 processes, but the world has 1"):
        plan.check_world(1)


def _held(model, opt) -> dict:
    """The parameters this rank's optimizer steps, whole (tp shards gathered)."""
    stepped = {id(p) for p in _stage_params(opt)}
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
        if id(p) in stepped
    }


def _checkpoint_worker(folder):
    from tessera.train import sharded_checkpoint as sc
    from tessera.train.export import full_state_dict

    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(4)]

    def boosted(**plan):
        model = _model("llama", 2)
        return tessera.boost(model, _optimizer(model, "adamw"), tessera.Plan(**plan))

    model, opt = boosted(dp=2, pp=2, zero=1, microbatches=2)  # each dp rank holds half the states
    for batch in batches[:2]:
        opt.train_step(batch, causal_lm_loss)
    sc.save_sharded(model, opt, f"{folder}/pp")
    model, opt = boosted(dp=4, zero=1, chunk_mib=0.01)  # a pipelined checkpoint under ZeRO
    sc.load_sharded(model, opt, f"{folder}/pp")
    zero_loss = opt.train_step(batches[2], causal_lm_loss)["loss"]
    sc.save_sharded(model, opt, f"{folder}/zero")
    state = full_state_dict(model, opt)
    zero_params = {n: state[n] for n, _ in model.named_parameters()}
    model, opt = boosted(dp=1, pp=2, tp=2, schedule="gpipe", microbatches=2)  # and back into stages
    sc.load_sharded(model, opt, f"{folder}/zero")
    pp_loss = opt.train_step(batches[3], causal_lm_loss)["loss"]
    return zero_loss, zero_params, pp_loss, _held(model, opt), batches


def test_pipelined_checkpoints_load_under_other_plans(tmp_path):
    """Saved under pp2 x dp2 at ZeRO-1, loaded under ZeRO-1 over 4 ranks, saved again and loaded under
    pp2 x tp2: each continues the single-process run (Adam, 4 steps). Tolerances as above:
    the same fp32 sums in another order."""
    results = spawn(_checkpoint_worker, 4, str(tmp_path), timeout_s=600)
    batches = results[0][4]
    model = _model("llama", 2)
    opt = _optimizer(model, "adamw")
    losses, after = [], []
    for batch in batches:
        opt.zero_grad()
        loss = causal_lm_loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    covered = set()
    for zero_loss, zero_params, pp_loss, held, _ in results:
        assert zero_loss == pytest.approx(losses[2], rel=1e-5)
        assert pp_loss == pytest.approx(losses[3], rel=1e-5)
        for name, value in zero_params.items():
            torch.testing.assert_close(value, after[2][name], rtol=1e-4, atol=1e-5)
        for name, value in held.items():
            torch.testing.assert_close(value, after[3][name], rtol=1e-4, atol=1e-5)
            covered.add(name)
    assert covered == set(after[3])


def test_balanced_stages_minimise_the_costliest_stage():
    from tessera.parallel.pipeline import balanced_counts, layer_costs

    # 4 equal layers and a head worth 3.5 of them on the last stage: (3, 1) costs 3 vs 4.5,
    # where the even (2, 2) split would cost 2 vs 5.5
    assert balanced_counts([2.0] * 4, 2, last=7.0) == (3, 1)
    assert balanced_counts([5, 1, 1, 1, 1, 5], 2) == (3, 3)
    assert balanced_counts([1] * 7, 3, last=2) == (3, 3, 1)  # stage costs 3, 3, 1 + 2
    assert balanced_counts([1] * 4, 4) == (1, 1, 1, 1)
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        balanced_counts([1] * 3, 4)
    costs, first, last = layer_costs(tiny_llama(layers=3))
    assert costs == [costs[0]] * 3 and first == 0 and last == VOCAB * 32  # the untied head


def test_tessera_train_runs_pipelined_and_sequence_parallel_like_one_process(tmp_path, capsys):
    """`tessera train --recipe gpt2-text` with --pp 2 and with --sp 2 exports the weights one
    process trains (4 Adam steps; measured max difference 1e-6 / 4e-6 on weights of size ~1;
    atol 5e-5 leaves room for rounding, a wrong gradient moves weights by ~lr = 1e-3)."""
    from safetensors.torch import load_file

    from tessera.cli import main

    runs = {
        "one": ["--nproc", "1"],
        "pp": ["--nproc", "2", "--pp", "2", "--microbatches", "4"],
        "sp": ["--nproc", "2", "--sp", "2", "--sp-method", "ulysses"],
    }
    for name, flags in runs.items():
        assert (
            main(["train", "--recipe", "gpt2-text", "--steps", "4", "--out", str(tmp_path / name), *flags])
            == 0
        )
    out = capsys.readouterr().out
    assert "with dp=1 tp=1 pp=2 zero=0" in out and "with dp=1 tp=1 sp=2 zero=0" in out
    one = load_file(tmp_path / "one" / "hf" / "model.safetensors")
    for name in ("pp", "sp"):
        other = load_file(tmp_path / name / "hf" / "model.safetensors")
        assert set(other) == set(one)
        for key, value in one.items():
            torch.testing.assert_close(other[key], value, rtol=0, atol=5e-5, msg=f"{name} {key}")
    assert (
        main(
            [
                "train",
                "--recipe",
                "gpt2-text",
                "--nproc",
                "2",
                "--pp",
                "2",
                "--microbatches",
                "3",
                "--out",
                str(tmp_path / "bad"),
            ]
        )
        == 2
    )
    assert "does not split into dp=1 x microbatches=3" in capsys.readouterr().err


def _norm_input_worker():
    """The tokens a norm sees on each rank under sequence_parallel_norms (and without)."""
    seen = []
    for on in (True, False):
        model = _model("llama", 2)
        model, opt = tessera.boost(
            model, _optimizer(model, "sgd"), tessera.Plan(tp=2, sequence_parallel_norms=on)
        )
        norm = model.model.layers[1].post_attention_layernorm
        hook = norm.register_forward_pre_hook(
            lambda m, args: seen.append(
                (args[0].to_local() if hasattr(args[0], "to_local") else args[0]).shape[1]
            )
        )
        opt.train_step(_batches()[0], causal_lm_loss)
        hook.remove()
    return seen


def test_sequence_parallel_norms_equal_one_process_and_see_half_the_sequence():
    """Megatron-style sequence parallel: losses and parameters as one process (tolerances
    above), and each tp rank's norms run on half of the 12 tokens."""
    _check(CASES_SP_NORMS, spawn(_worker, 2, CASES_SP_NORMS, timeout_s=600))
    assert spawn(_norm_input_worker, 2) == [[SEQ // 2, SEQ]] * 2
