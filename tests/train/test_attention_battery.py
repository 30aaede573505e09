"""The attention battery: every family in attention_families.FAMILIES trained on padded
batches (left- and right-padded rows) under pipeline parallel (pp2), sequence parallel
(sp2, Ring and Ulysses), pp2 x sp2 and dp2 with ZeRO, against one process training on
the whole batch: the same losses every step and the same parameters after 2 steps, from the
same weights. The features each family brings: padding masks (llama), a sliding window on
every layer (mistral), full then sliding layers (qwen2), alternating windows with attention
and final logit soft-caps and a non-default scale (gemma2), per-kind rotary bases
(gemma3_text), attention sinks (gpt_oss). Families the paths cannot reproduce are refused
by name (test_refused_families_*).

Mutants: the same check with a deliberately wrong kernel (the padding mask dropped, the
window ignored, the soft-cap or the sinks dropped, one mask for every layer kind) must
fail; otherwise the check could not have seen the feature.

Tolerances: parallel runs sum the same gradients in another order (micro-batches, the dp
average, ring attention's log-sum-exp merge, Ulysses' head split), fp32 rounding measured
<= 1e-6 relative per step; after 2 SGD steps at lr 0.5 parameters are compared at rtol 1e-4 /
atol 1e-5, losses at rtol 1e-5. A dropped feature moves the loss by 1e-3 or more here (the
mutants show it), so these bounds cannot hide one.
"""

import contextlib

import torch
from attention_families import FAMILIES, padded_batches, tiny_family

import tessera
from tessera.runtime import spawn
from tessera.train.losses import causal_lm_loss

STEPS = 2
LOSS_RTOL, PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-4, 1e-5


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.5)


def reference(family: str):
    model = tiny_family(family)
    opt = _optimizer(model)
    losses = []
    for batch in padded_batches(STEPS):
        opt.zero_grad()
        loss = causal_lm_loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def mutant(name: str):
    """A deliberately wrong kernel for the duration (``None``: the real one)."""
    from tessera.parallel import attention_blocks, pipeline, sequence

    patches = []
    if name == "padding_dropped":  # sp: every key counts; pp: the stages see no padding
        patches += [(sequence, "_keys", lambda key_valid, ks: None)]
        real_masks = pipeline.DecoderStage._masks
        patches += [(pipeline.DecoderStage, "_masks", lambda self, x, pos, m: real_masks(self, x, pos, None))]
    elif name == "window_ignored":
        real_cut, real_mask = attention_blocks.Visibility.cut, attention_blocks.Visibility.mask

        def no_window(fn):
            return lambda self, *a: fn(
                attention_blocks.Visibility(scale=self.scale, softcap=self.softcap), *a
            )

        patches += [
            (attention_blocks.Visibility, "cut", no_window(real_cut)),
            (attention_blocks.Visibility, "mask", no_window(real_mask)),
            (pipeline.DecoderStage, "layer_kind", lambda self, i: "full_attention"),
        ]
    elif name == "softcap_dropped":
        real = sequence._visibility
        patches += [(sequence, "_visibility", lambda m, q, sc, w, cap: real(m, q, sc, w, None))]
    elif name == "sinks_dropped":
        patches += [(attention_blocks, "add_sinks", lambda out, lse, sinks: (out, lse))]
        patches += [(sequence, "add_sinks", lambda out, lse, sinks: (out, lse))]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, value in patches:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def _worker(cases):
    out = []
    for family, plan_kwargs, broken in cases:
        with mutant(broken):
            model = tiny_family(family)
            try:
                model, opt = tessera.boost(model, _optimizer(model), tessera.Plan(**plan_kwargs))
            except ValueError as e:
                if broken is None:
                    raise
                out.append(f"refused at set-up: {e}")  # the pipeline's probe caught the mutant
                continue
            losses = [opt.train_step(batch, causal_lm_loss)["loss"] for batch in padded_batches(STEPS)]
        if hasattr(opt, "trainer"):  # pipelined: this rank's stages' parameters
            stepped = {id(p) for p in opt.stepped_parameters}
            held = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in stepped}
        else:
            from tessera.train.export import full_state_dict

            state = full_state_dict(model, opt)
            held = {n: state[n] for n, _ in model.named_parameters()}
        out.append((losses, held))
    return out


def _differences(cases, results) -> list[str]:
    """For each case, what differs from one process ('' where everything is within bounds)."""
    refs = {family: reference(family) for family in {c[0] for c in cases}}
    found = []
    for i, (family, _, _) in enumerate(cases):
        ref_losses, ref_params = refs[family]
        if any(isinstance(r[i], str) for r in results):
            found.append(next(r[i] for r in results if isinstance(r[i], str)))
            continue
        bad, covered = [], set()
        for losses, held in (r[i] for r in results):
            if not torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0):
                bad.append(f"losses {losses} vs {ref_losses}")
            for name, value in held.items():
                covered.add(name)
                if not torch.allclose(value, ref_params[name], rtol=PARAM_RTOL, atol=PARAM_ATOL):
                    err = float((value - ref_params[name]).abs().max())
                    bad.append(f"{name} off by {err:.2e}")
        if covered != set(ref_params):
            bad.append(f"no rank holds {sorted(set(ref_params) - covered)}")
        found.append("; ".join(bad[:3]))
    return found


PATHS_2 = {
    "pp2": dict(pp=2, microbatches=2, schedule="1f1b"),
    "sp2_ring": dict(sp=2, sp_method="ring"),
    "sp2_ulysses": dict(sp=2, sp_method="ulysses"),
}
CASES_2 = [(family, plan, None) for family in FAMILIES for plan in PATHS_2.values()]
# each mutant on a path and family where its feature matters
MUTANTS_2 = [
    ("llama", PATHS_2["sp2_ring"], "padding_dropped"),
    ("llama", PATHS_2["sp2_ulysses"], "padding_dropped"),
    ("llama", PATHS_2["pp2"], "padding_dropped"),
    ("mistral", PATHS_2["sp2_ring"], "window_ignored"),
    ("qwen2", PATHS_2["sp2_ulysses"], "window_ignored"),
    ("mistral", PATHS_2["pp2"], "window_ignored"),
    ("gemma2", PATHS_2["sp2_ring"], "softcap_dropped"),
    ("gpt_oss", PATHS_2["sp2_ring"], "sinks_dropped"),
    ("gpt_oss", PATHS_2["sp2_ulysses"], "sinks_dropped"),
]
CASES_4 = [
    ("mistral", dict(pp=2, sp=2, sp_method="ring", microbatches=2), None),
    ("gemma2", dict(pp=2, sp=2, sp_method="ulysses", microbatches=2), None),
    ("llama", dict(dp=2, sp=2, sp_method="ring", zero=1, chunk_mib=0.01), None),
    ("gpt_oss", dict(dp=2, pp=2, microbatches=2), None),
    ("qwen2", dict(dp=4, zero=3, chunk_mib=0.01), None),  # padding through the ZeRO path alone
]


REFUSALS = [  # (family, plan, what the one-line error says), checked on 2 ranks
    ("bloom", dict(sp=2), "does not dispatch its attention through transformers' AttentionInterface"),
    ("falcon", dict(sp=2), "does not dispatch its attention through transformers' AttentionInterface"),
    ("bloom", dict(pp=2, microbatches=2), "pipeline stages need GPT-2"),
    ("granite", dict(pp=2, microbatches=2), "pipeline stages do not reproduce the model's forward"),
]


def _refusals(cases):
    """Each refused in boost's checks: its message, and whether the model was left as given
    (same values, same attention implementation)."""
    out = []
    for family, plan_kwargs, _ in cases:
        model = tiny_family(family)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        implementation = model.config._attn_implementation
        try:
            tessera.boost(model, _optimizer(model), tessera.Plan(**plan_kwargs))
            message = None
        except ValueError as e:
            message = str(e)
        same = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        out.append((message, same and model.config._attn_implementation == implementation))
    return out


def _worker_2(cases, refusals):
    return _worker(cases), _refusals(refusals)


def test_attention_features_equal_one_process_on_2_ranks():
    cases = CASES_2 + MUTANTS_2
    results = spawn(_worker_2, 2, cases, REFUSALS, timeout_s=600)
    found = _differences(cases, [r[0] for r in results])
    for (family, plan, broken), diff in zip(cases, found, strict=True):
        if broken is None:
            assert diff == "", f"{family} {plan}: {diff}"
        else:
            assert diff != "", f"{family} {plan} with the {broken} mutant still equals one process"
    for (family, plan, expected), (message, untouched) in zip(REFUSALS, results[0][1], strict=True):
        assert message is not None and expected in message and "\n" not in message, (family, plan, message)
        assert untouched, f"{family} {plan}: the refused boost changed the model"


def test_attention_features_equal_one_process_on_4_ranks():
    found = _differences(CASES_4, spawn(_worker, 4, CASES_4, timeout_s=600))
    for (family, plan, _), diff in zip(CASES_4, found, strict=True):
        assert diff == "", f"{family} {plan}: {diff}"
