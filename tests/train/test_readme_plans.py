"""The README's training example, its own code, runs unchanged under Plan(dp=2), Plan(tp=2),
Plan(pp=2) and Plan(sp=2) in one 2-rank group, and each run equals one process training the
same model on the whole batch (#28 item 3: one optimizer interface, one loss protocol).

The block is read from README.md (the python fence that calls ``tessera.boost``) and run as
written, with two substitutions, each asserted to match exactly once so a reshaped example
fails here: the model's size (``GPT2Config(...)``: a 2-layer, 32-wide GPT-2 without dropout,
so that it runs in seconds and equals a reference) and the plan (``tessera.Plan(...)``: the
plan under test). ``batches`` is given: 3 global batches, the same on every rank; it records
each step's ``stats`` as the loop asks for the next batch.

Compared with the one-process reference (plain AdamW as the example builds it, lr 3e-4,
the same clipping): every step's loss and global gradient norm, and the parameters after 3
steps (gathered with ``export.full_state_dict``), and the optimizer's ``state_dict()`` (the
protocol's whole state, pipelined too), which ``load_state_dict`` takes back unchanged.

Tolerances: the plans sum the same fp32 products in another order (dp all-reduce, tp partial
sums, ring attention's log-sum-exp merge, pipeline micro-batches averaged): measured below
1e-6 relative on losses and norms, compared at rtol 1e-5 / 1e-4. Adam divides by
sqrt(v) + 1e-8, so an element whose gradient is ~0 can move by up to lr (3e-4) per step on
rounding noise; parameters are compared at atol 1e-5 with rtol 1e-4, which measured passes
(the largest difference is printed on failure) and a wrong gradient fails by ~lr. Adam's
moments: measured within 1.1e-6 of the largest; compared at rtol 2e-4 (exp_avg_sq squares
the gradients' rounding) with atol 1e-9 for elements near zero.
"""

import os
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from tiny_lm import SEQ, VOCAB

import tessera
from tessera.runtime import spawn

README = Path(__file__).resolve().parents[2] / "README.md"
STEPS, BATCH = 3, 8
TINY = dict(
    vocab_size=VOCAB,
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=SEQ,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
# max_grad_norm on: stats then carry the global gradient norm (a gradient's scale shows there)
PLANS = {
    "dp": dict(dp=2, zero=3, max_grad_norm=1.0),
    "tp": dict(tp=2, zero=3, max_grad_norm=1.0),
    "pp": dict(pp=2, zero=1, max_grad_norm=1.0),
    "sp": dict(sp=2, zero=3, max_grad_norm=1.0),
}


def readme_training_code() -> str:
    """The README's training example with the model size and the plan made names."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    code = next(b for b in blocks if "tessera.boost(" in b)
    code, n_config = re.subn(r"GPT2Config\([^)]*\)", "GPT2Config(**TINY)", code)
    code, n_plan = re.subn(r"tessera\.Plan\([^)]*\)", "PLAN", code)
    assert (n_config, n_plan) == (1, 1), f"README example changed shape: {n_config} configs, {n_plan} plans"
    return code


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def reference() -> tuple[list[float], list[float], dict, dict]:
    """One process: the example's model and AdamW on the whole batch, clipped as the plans."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tessera.train.losses import causal_lm_loss

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    losses, norms = [], []
    for batch in _batches():
        opt.zero_grad()
        loss = causal_lm_loss(model, batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict()


@contextmanager
def _torchrun_env():
    """The variables init_from_env reads (the group is joined already: it returns at once)."""
    keep = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(
        RANK=str(torch.distributed.get_rank()),
        WORLD_SIZE=str(torch.distributed.get_world_size()),
        MASTER_ADDR=keep["MASTER_ADDR"] or "127.0.0.1",
        MASTER_PORT=keep["MASTER_PORT"] or "0",
    )
    try:
        yield
    finally:
        for k, v in keep.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_plans(code: str) -> dict:
    from tessera.train.export import full_state_dict
    from tessera.train.optimizer import TrainOptimizer

    out = {}
    for name, settings in PLANS.items():
        torch.manual_seed(0)  # the example builds its model here: the reference's weights
        ns: dict = {"TINY": TINY, "PLAN": tessera.Plan(**settings)}
        seen: list[dict] = []

        def batches(ns=ns, seen=seen):
            for b in _batches():
                yield b
                seen.append(ns["stats"])  # the loop body ran: this step's stats

        ns["batches"] = batches()
        with _torchrun_env():
            exec(compile(code, str(README), "exec"), ns)
        model, opt = ns["model"], ns["optimizer"]
        state = full_state_dict(model, opt)
        optim = opt.state_dict()  # the protocol's whole state, under every plan (pp too)
        opt.load_state_dict(optim)  # and back: each rank keeps its shards of it
        out[name] = {
            "protocol": isinstance(opt, TrainOptimizer),
            "type": type(opt).__name__,
            "losses": [s["loss"] for s in seen],
            "norms": [s["grad_norm"] for s in seen],
            "params": {n: state[n] for n in dict(model.named_parameters(remove_duplicate=False))},
            "optim": optim,
            "reloaded": opt.state_dict(),
        }
    return out


def test_readme_example_runs_unchanged_under_dp_tp_pp_and_sp():
    code = readme_training_code()
    got = spawn(run_plans, 2, code)[0]
    losses, norms, params, optim = reference()
    for name in PLANS:
        r = got[name]
        assert r["protocol"], f"{name}: {r['type']} is not a TrainOptimizer"
        assert len(r["losses"]) == STEPS, name
        torch.testing.assert_close(r["losses"], losses, rtol=1e-5, atol=0, msg=name)
        torch.testing.assert_close(r["norms"], norms, rtol=1e-4, atol=0, msg=name)
        for n, want in params.items():
            torch.testing.assert_close(r["params"][n], want, rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")
        # Adam's moments: exp_avg is a sum of gradients (their tolerance), exp_avg_sq of their
        # squares (twice the relative error); "step" and the groups' settings exactly
        assert r["optim"]["param_groups"] == optim["param_groups"], name
        assert r["optim"]["state"].keys() == optim["state"].keys(), name
        for i, entry in optim["state"].items():
            for key, want in entry.items():
                value = r["optim"]["state"][i][key]
                torch.testing.assert_close(value, want, rtol=2e-4, atol=1e-9, msg=f"{name}: state {i} {key}")
                torch.testing.assert_close(r["reloaded"]["state"][i][key], value, rtol=0, atol=0)
