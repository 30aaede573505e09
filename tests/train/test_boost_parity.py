"""tessera.boost against single-process training: every plan (dp, ZeRO 1/2/3, tp, dp x tp,
with gradient accumulation and global-norm clipping on) takes the same steps from the same
weights on the same global batches, on CPU/gloo.

Tolerances: parallel runs sum the same gradients in a different order (a dp all-reduce or
reduce-scatter, tp partial sums, micro-batches accumulated instead of one batch) — fp32
rounding, ~1e-7 relative per step. Adam divides by sqrt(v): an element whose gradient is
near zero can turn a rounding difference into a visible one (hence eps 1e-4 below), so
parameters are compared with rtol 1e-4 / atol 1e-5 after 3 steps at lr 1e-2, and losses
with rtol 1e-5.
"""

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from tessera.runtime import spawn
from tessera.train.boost import boost
from tessera.train.plan import Plan

STEPS = 3
GLOBAL_BATCH, SEQ, VOCAB = 8, 12, 128


def _llama(kv_heads=2, tied=False):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def _gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)  # lm_head is tied to the token embedding
    model.unused = nn.Linear(4, 4)  # a parameter no step uses
    return model


BUILDERS = {
    "llama": _llama,  # grouped-query attention: 4 query heads, 2 key/value heads
    "llama_tied": lambda: _llama(kv_heads=4, tied=True),
    "gpt2": _gpt2,
}


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(STEPS)]


def lm_loss(model, tokens):
    logits = model(input_ids=tokens).logits
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
    return nn.functional.cross_entropy(shifted, tokens[:, 1:].reshape(-1))


def _optimizer(model):
    # eps 1e-4, not 1e-8: some elements' true gradient is exactly zero (attention ignores the
    # key bias), and Adam would turn their rounding noise (~1e-10) into lr-sized steps.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.0)


def _full_params(model, optimizer) -> dict[str, torch.Tensor]:
    if optimizer is not None and optimizer.plan.zero == 3:
        optimizer.engine.gather_all()
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def reference(family: str, max_norm: float | None):
    model = BUILDERS[family]()
    opt = _optimizer(model)
    losses = []
    for tokens in _batches():
        opt.zero_grad()
        loss = lm_loss(model, tokens)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
    return losses, _full_params(model, None)


def _worker(runs):
    results = []
    for family, plan_kwargs in runs:
        model = BUILDERS[family]()
        model, opt = boost(model, _optimizer(model), Plan(**plan_kwargs))
        losses = [opt.train_step(tokens, lm_loss)["loss"] for tokens in _batches()]
        results.append((losses, _full_params(model, opt)))
    return results


def _check(runs, results):
    for (family, plan_kwargs), (losses, params) in zip(runs, results, strict=True):
        ref_losses, ref_params = reference(family, plan_kwargs.get("max_grad_norm"))
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(ref_losses),
            rtol=1e-5,
            atol=1e-6,
            msg=f"{family} {plan_kwargs} losses {losses} vs {ref_losses}",
        )
        assert ref_params.keys() == params.keys()
        label = f"{family} {plan_kwargs}"
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                params[name],
                ref,
                rtol=1e-4,
                atol=1e-5,
                msg=lambda m, n=name, label=label: f"{label} {n}: {m}",
            )
        start = dict(BUILDERS[family]().named_parameters())
        assert (
            sum(not torch.equal(ref_params[n], start[n]) for n in ref_params) > len(ref_params) // 2
        )  # it trained
        if "unused.weight" in params:
            torch.testing.assert_close(params["unused.weight"], start["unused.weight"], rtol=0, atol=0)


CLIP = 0.5  # below the measured first-step gradient norms (0.95-1.17), so clipping is active


def test_data_parallel_and_zero_stages_on_two_ranks():
    runs = [
        ("gpt2", dict(dp=2)),
        ("gpt2", dict(dp=2, zero=1, grad_accum=2, max_grad_norm=CLIP)),
        ("gpt2", dict(dp=2, zero=2, grad_accum=2, max_grad_norm=CLIP)),
        ("gpt2", dict(dp=2, zero=3, grad_accum=2, max_grad_norm=CLIP, chunk_mib=0.01)),
        ("llama", dict(dp=2, zero=3)),
    ]
    _check(runs, spawn(_worker, 2, runs)[0])


def test_tensor_parallel_and_dp_x_tp_on_four_ranks():
    runs = [
        ("llama_tied", dict(tp=4, max_grad_norm=CLIP)),
        ("llama", dict(dp=2, tp=2, zero=2, grad_accum=2, max_grad_norm=CLIP)),
        ("llama", dict(dp=2, tp=2, zero=1)),
    ]
    _check(runs, spawn(_worker, 4, runs)[0])
