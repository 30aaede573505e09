"""tessera.boost against single-process training: every plan (dp, ZeRO 1/2/3, tp, dp x tp,
with gradient accumulation, global-norm clipping, activation checkpointing and block-aligned
chunks) takes the same steps from the same weights on the same global batches, on CPU/gloo.

Adam is nearly blind to a gradient's scale (it divides by sqrt(v)), so a gradient summed over
ranks instead of averaged would pass an Adam-only test: plain SGD runs beside it, where a
parameter moves by exactly lr x gradient, and ZeRO-1/2/3 run with several chunks per rank
(small chunk_mib), so every chunk's reduction and every shard's ownership is exercised.

Tolerances: parallel runs sum the same gradients in a different order (a dp all-reduce or
reduce-scatter, tp partial sums, micro-batches accumulated instead of one batch) — fp32
rounding, ~1e-7 relative per step. Adam divides by sqrt(v): an element whose gradient is
near zero can turn a rounding difference into a visible one (hence eps 1e-4 below), so
parameters are compared with rtol 1e-4 / atol 1e-5 after 3 steps at lr 1e-2, and losses
with rtol 1e-5. SGD (lr 0.5) moves a parameter by lr x gradient (~1e-3 here): the same fp32
rounding stays below 1e-6, a factor-2 error in a gradient moves it by ~1e-3.
"""

import torch
from tiny_lm import SEQ, VOCAB, tiny_gpt2, tiny_llama
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2LMHeadModel,
)

import tessera
from tessera.models.dit import DiT, DiTConfig
from tessera.runtime import spawn
from tessera.train.export import full_state_dict
from tessera.train.losses import causal_lm_loss

STEPS = 3
GLOBAL_BATCH = 8


def _gpt2():
    model = tiny_gpt2()  # lm_head is tied to the token embedding
    model.unused = nn.Linear(4, 4)  # a parameter no step uses
    return model


def _bert():
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(cfg)  # decoder tied to the word embedding


def _dit():
    torch.manual_seed(0)
    return DiT(DiTConfig(image_size=8, patch_size=2, hidden_size=32, depth=2, num_heads=4))


BUILDERS = {
    "llama": tiny_llama,  # grouped-query attention: 4 query heads, 2 key/value heads
    "llama_tied": lambda: tiny_llama(kv_heads=4, tied=True),
    "gpt2": _gpt2,
    "bert": _bert,
    "dit": _dit,
}


def _batches(family="llama"):
    g = torch.Generator().manual_seed(3)
    if family == "dit":
        return [
            (
                torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=g),
                torch.rand(GLOBAL_BATCH, generator=g),
                torch.randint(0, 10, (GLOBAL_BATCH,), generator=g),
                torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=g),
            )
            for _ in range(STEPS)
        ]
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(STEPS)]


def dit_loss(model, batch):
    x, t, y, target = batch
    return nn.functional.mse_loss(model(x, t, y), target)


def _loss(family):
    return dit_loss if family == "dit" else causal_lm_loss


def _optimizer(model, kind="adamw"):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    # eps 1e-4, not 1e-8: some elements' true gradient is exactly zero (attention ignores the
    # key bias), and Adam would turn their rounding noise (~1e-10) into lr-sized steps.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.0)


def _full_params(model, optimizer) -> dict[str, torch.Tensor]:
    """Parameters whole, in the model class's own layout (export's gather undoes TP layouts)."""
    state = full_state_dict(model, optimizer)
    names = [n for n, _ in model.named_parameters()]
    return {n: state[n] for n in names}


def reference(family: str, max_norm: float | None, precision: str = "fp32", kind: str = "adamw"):
    model = BUILDERS[family]()
    opt = _optimizer(model, kind)
    losses = []
    for batch in _batches(family):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = _loss(family)(model, batch)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
    return losses, _full_params(model, None)


def _run(spec):
    family, plan_kwargs, *kind = spec
    return family, plan_kwargs, (kind or ["adamw"])[0]


def _worker(runs):
    results = []
    for family, plan_kwargs, kind in map(_run, runs):
        model = BUILDERS[family]()
        model, opt = tessera.boost(model, _optimizer(model, kind), tessera.Plan(**plan_kwargs))
        if plan_kwargs.get("chunk_mib", 32) < 0.1:
            assert len(opt.engine.groups) >= 4, len(opt.engine.groups)  # several chunks per rank
        losses = [opt.train_step(batch, _loss(family))["loss"] for batch in _batches(family)]
        results.append((losses, _full_params(model, opt), opt.mesh.comm.ledger.snapshot()))
    return results


def _check(runs, results):
    for (family, plan_kwargs, kind), (losses, params, comm) in zip(map(_run, runs), results, strict=True):
        # every axis that is split moved bytes, counted per axis (tp: DTensor's collectives)
        for axis in ("dp", "tp"):
            moved = sum(v["bytes"] for k, v in comm.items() if k.endswith("@" + axis))
            assert (moved > 0) == (plan_kwargs.get(axis, 1) > 1), (family, plan_kwargs, comm)
        precision = plan_kwargs.get("precision", "fp32")
        ref_losses, ref_params = reference(family, plan_kwargs.get("max_grad_norm"), precision, kind)
        # bf16 autocast: matmuls round to 8 bits of mantissa, and a half-batch rounds
        # differently from the whole one, so losses agree to ~1e-3; Adam turns the rounding
        # of a near-zero gradient into a visibly different step for a few elements
        # (measured: 1 of 4096 at 3.2e-3 after 3 steps of lr 1e-2). fp32 as above.
        loss_tol, param_tol = (
            ((1e-5, 1e-6), (1e-4, 1e-5)) if precision == "fp32" else ((5e-3, 5e-3), (2e-2, 6e-3))
        )
        if kind == "sgd":
            param_tol = (1e-5, 1e-6)
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(ref_losses),
            rtol=loss_tol[0],
            atol=loss_tol[1],
            msg=f"{family} {plan_kwargs} losses {losses} vs {ref_losses}",
        )
        assert ref_params.keys() == params.keys()
        label = f"{family} {plan_kwargs} {kind}"
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                params[name],
                ref,
                rtol=param_tol[0],
                atol=param_tol[1],
                msg=lambda m, n=name, label=label: f"{label} {n}: {m}",
            )
        start = dict(BUILDERS[family]().named_parameters())
        assert (
            sum(not torch.equal(ref_params[n], start[n]) for n in ref_params) > len(ref_params) // 2
        )  # it trained
        if "unused.weight" in params:  # exact: no step may touch a parameter no loss uses
            torch.testing.assert_close(params["unused.weight"], start["unused.weight"], rtol=0, atol=0)


CLIP = 0.5  # below the measured first-step gradient norms (0.95-1.17), so clipping is active


def test_data_parallel_and_zero_stages_on_two_ranks():
    runs = [
        ("gpt2", dict(dp=2)),
        ("gpt2", dict(dp=2, zero=1, grad_accum=2, max_grad_norm=CLIP, chunk_mib=0.01)),
        ("gpt2", dict(dp=2, zero=2, grad_accum=2, max_grad_norm=CLIP, chunk_mib=0.01)),
        ("gpt2", dict(dp=2, zero=3, grad_accum=2, max_grad_norm=CLIP, chunk_mib=0.01)),
        ("llama", dict(dp=2, zero=3)),
        ("llama", dict(dp=2, zero=2, precision="bf16")),
        # SGD: a parameter moves by lr x the (averaged) gradient
        ("gpt2", dict(dp=2), "sgd"),
        ("gpt2", dict(dp=2, zero=1, chunk_mib=0.01, grad_accum=2, max_grad_norm=CLIP), "sgd"),
        ("gpt2", dict(dp=2, zero=2, chunk_mib=0.01), "sgd"),
        ("llama", dict(dp=2, zero=3, chunk_mib=0.01, grad_accum=2), "sgd"),
        # activation checkpointing: recomputed blocks give the same gradients (at ZeRO-3 the
        # recomputation re-gathers freed chunks); block-aligned chunks
        ("gpt2", dict(dp=2, zero=3, chunk_mib=0.01, grad_accum=2, activation_checkpointing=True), "sgd"),
        ("llama", dict(dp=2, zero=3, block_chunks=True, activation_checkpointing=True)),
        ("dit", dict(dp=2, zero=2, block_chunks=True, activation_checkpointing=True, max_grad_norm=CLIP)),
    ]
    _check(runs, spawn(_worker, 2, runs)[0])


def test_tensor_parallel_and_dp_x_tp_on_four_ranks():
    runs = [
        ("llama_tied", dict(tp=4, max_grad_norm=CLIP)),
        ("llama", dict(dp=2, tp=2, zero=2, grad_accum=2, max_grad_norm=CLIP)),
        ("llama", dict(dp=2, tp=2, zero=1)),
        ("llama_tied", dict(dp=2, tp=2, zero=3, chunk_mib=0.01)),
        ("gpt2", dict(tp=4, max_grad_norm=CLIP)),
        ("gpt2", dict(dp=2, tp=2, zero=3, grad_accum=2, max_grad_norm=CLIP)),
        ("bert", dict(dp=2, tp=2, max_grad_norm=CLIP)),
        ("dit", dict(dp=2, tp=2, zero=1, max_grad_norm=CLIP)),
        ("llama", dict(dp=2, tp=2, zero=2, chunk_mib=0.005, grad_accum=2), "sgd"),
    ]
    _check(runs, spawn(_worker, 4, runs)[0])


def _export_worker(folder):
    model = BUILDERS["gpt2"]()
    del model.unused
    model, opt = tessera.boost(model, _optimizer(model), tessera.Plan(tp=2, zero=0))
    for batch in _batches()[:1]:
        opt.train_step(batch, causal_lm_loss)
    from tessera.train.export import save_hf

    save_hf(model, opt, folder, is_writer=torch.distributed.get_rank() == 0)
    return _full_params(model, opt)


def test_export_after_tensor_parallel_loads_with_from_pretrained(tmp_path):
    """GPT-2 trained at tp=2 (Conv1D turned Linear, q|k|v reordered) exports to a folder
    GPT2LMHeadModel.from_pretrained loads with the same (HF-layout) weights."""
    folder = tmp_path / "gpt2-export"
    params = spawn(_export_worker, 2, str(folder))[0]
    loaded = GPT2LMHeadModel.from_pretrained(folder)
    assert not list(tmp_path.glob(".*partial*"))  # written atomically: no temporary left
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, params[name], rtol=0, atol=0, msg=name)  # exact: the saved fp32 values
    logits = loaded(input_ids=_batches()[0][:2]).logits
    assert logits.shape == (2, SEQ, VOCAB) and torch.isfinite(logits).all()


class _RankDependent(nn.Module):
    """Uses ``extra`` only on dp rank 1: its gradient exists on one rank only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.extra, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = self.body(x)
        if torch.distributed.get_rank() == 1:
            h = h + self.extra(h)
        return self.head(h)


def _rank_dependent_worker(zero):
    model = _RankDependent()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, opt = tessera.boost(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tessera.Plan(dp=2, zero=zero)
    )
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        opt.train_step(x, lambda m, b: m(b).pow(2).mean())
    return start, _full_params(model, opt)


def test_a_parameter_used_on_one_rank_only_keeps_the_replicas_equal():
    """Collectives pair up in one fixed order, and the rank that did not use ``extra`` takes
    the averaged gradient too: every replica holds the same weights, and ``extra`` moved.
    (ZeRO-3 gathers a module's chunks when the module runs, so, as with FSDP, every rank
    must run the same modules; it is not part of this test.)"""
    for zero in (0, 1, 2):
        (start, a), (_, b) = spawn(_rank_dependent_worker, 2, zero)
        for name in a:  # exact: both replicas apply the same reduced gradient with the same ops
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=f"zero={zero} {name}")
        assert not torch.equal(a["extra.weight"], start["extra.weight"]), zero
