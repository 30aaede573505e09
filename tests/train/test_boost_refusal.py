"""A refused ``tessera.boost`` leaves the caller's model and optimizer exactly as given
(issue #25): the same parameter objects holding the same values in the same storage, the
same modules and hooks, the same optimizer groups and state. So the boost the refusal
advises, on the same model, trains bit-exactly as a fresh model boosted with that plan.

Refusals covered, each made before anything changes: an offload budget below what the
largest chunk needs (it used to bind and free every ZeRO-3 chunk first: a second boost of
the emptied model crashed the process), an offload directory that is a file, a chunk size
below the largest parameter, a tensor parallel plan whose tied weights split differently
(it used to shard the model first) or that names an unknown style after GPT-2's layout
change, and pipeline stage counts that do not sum to the layers (activation checkpointing
was switched on first). All comparisons are exact (torch.equal, ==): the same arithmetic
runs in the same order on the same values, so any difference is a bug, not rounding.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from tiny_lm import SEQ, VOCAB, tiny_gpt2

import tessera
from tessera.parallel.tp_plans import TPPlan, plan_for
from tessera.runtime import spawn
from tessera.train.losses import causal_lm_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offload"))
import offload_lm  # noqa: E402

STEPS = 2


def _batches(n: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (8, SEQ), generator=g) for _ in range(n)]


# ---- what "unchanged" means -----------------------------------------------------------------
def _snapshot(model, optimizer) -> dict:
    modules = {}
    for name, m in model.named_modules():
        attrs = {k: (v, dict(v) if isinstance(v, dict) else None) for k, v in vars(m).items()}
        modules[name] = (m, attrs)
    params = [
        (n, p, _values(p), p.data_ptr(), p.device, dict(p._post_accumulate_grad_hooks or {}), p.grad)
        for n, p in model.named_parameters()
    ]
    groups = [
        ({k: v for k, v in g.items() if k != "params"}, list(g["params"])) for g in optimizer.param_groups
    ]
    state = {
        p: {k: (v, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    return dict(modules=modules, params=params, groups=groups, state=state)


def _values(p: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``p``'s values; None where ZeRO-3 emptied its storage (reading it would crash)."""
    return p.detach().clone() if p.untyped_storage().nbytes() else None


def _same_dict(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(b[k] is v for k, v in a.items())


def _unchanged(before: dict, model, optimizer) -> list[str]:
    """What differs from ``before`` (empty: nothing)."""
    now = _snapshot(model, optimizer)
    if list(now["modules"]) != list(before["modules"]) or len(now["params"]) != len(before["params"]):
        return ["module tree"]
    diffs = []
    for name, (m, attrs) in before["modules"].items():
        m2, attrs2 = now["modules"][name]
        if m2 is not m or attrs.keys() != attrs2.keys():
            diffs.append(f"module {name!r}")
            continue
        for k, (v, contents) in attrs.items():  # hooks, submodules, parameters, forward, ...
            v2, contents2 = attrs2[k]
            if v2 is not v or (contents is not None and not _same_dict(contents, contents2)):
                diffs.append(f"module {name!r} attribute {k}")
    for (n, p, value, ptr, device, hooks, grad), (n2, p2, _, ptr2, device2, hooks2, grad2) in zip(
        before["params"], now["params"], strict=True
    ):
        if (n2, device2, ptr2) != (n, device, ptr) or p2 is not p or grad2 is not grad:
            diffs.append(f"parameter {n}")
        elif value is None or (now_value := _values(p)) is None or not torch.equal(now_value, value):
            diffs.append(f"parameter {n} values")
        if hooks2.keys() != hooks.keys():
            diffs.append(f"parameter {n} hooks")
    groups = [(h, dict(enumerate(ps))) for h, ps in before["groups"]]
    groups2 = [(h, dict(enumerate(ps))) for h, ps in now["groups"]]
    if len(groups) != len(groups2) or any(
        h != h2 or not _same_dict(ps, ps2) for (h, ps), (h2, ps2) in zip(groups, groups2, strict=False)
    ):
        diffs.append("param_groups")
    state2 = now["state"]
    if state2.keys() != before["state"].keys():
        diffs.append("optimizer state keys")
    for p, entries in before["state"].items():
        for k, (v, value) in entries.items():
            v2 = state2.get(p, {}).get(k, (None,))[0]
            same = torch.equal(v2, value) if isinstance(value, torch.Tensor) else v2 == value
            if v2 is not v or not same:
                diffs.append(f"optimizer state {k}")
    return diffs


def _refused(model, optimizer, plan, tp_plan=None) -> tuple[str | None, list[str]]:
    """(the refusal's message or None, what the refused boost changed)."""
    before = _snapshot(model, optimizer)
    try:
        tessera.boost(model, optimizer, plan, tp_plan=tp_plan)
        message = None
    except ValueError as e:
        message = str(e)
    return message, _unchanged(before, model, optimizer)


# ---- the cases ------------------------------------------------------------------------------
def _offload_case(tmp: Path) -> dict:
    """dp=2, ZeRO-3 with offload; the optimizer holds state from one plain step (loaded again
    by the boost that works)."""
    steps = offload_lm.batches(n=3)
    base = tessera.Plan(dp=2, zero=3, chunk_mib=offload_lm.CHUNK_MIB, max_grad_norm=0.5, offload="auto")
    valid = dataclasses.replace(base, host_memory=offload_lm.HOST_MEMORY, offload_dir=str(tmp / "ok"))
    not_a_dir = tmp / "file"
    not_a_dir.write_text("x")
    refusals = {
        "budget": dataclasses.replace(valid, host_memory=1000, offload_dir=str(tmp / "refused")),
        "directory": dataclasses.replace(valid, offload_dir=str(not_a_dir)),
        "chunk": dataclasses.replace(valid, chunk_mib=0.001),
    }

    def fresh():
        model = offload_lm.model()
        opt = offload_lm.optimizer(model)
        causal_lm_loss(model, steps[0]).backward()  # the same plain step on every rank
        opt.step()
        opt.zero_grad()
        return model, opt

    model, opt = fresh()
    found = {name: _refused(model, opt, plan) for name, plan in refusals.items()}
    found["no directory left"] = not (tmp / "refused").exists()
    model, opt = tessera.boost(model, opt, valid)  # the same model, as the refusal advises
    ref_model, ref_opt = fresh()
    # its own directory: two stores in one would overwrite each other's chunk files
    ref_model, ref_opt = tessera.boost(
        ref_model, ref_opt, dataclasses.replace(valid, offload_dir=str(tmp / "ref"))
    )
    losses = [opt.train_step(b, causal_lm_loss)["loss"] for b in steps[1:]]
    ref_losses = [ref_opt.train_step(b, causal_lm_loss)["loss"] for b in steps[1:]]
    same = [
        torch.equal(a, b)
        for a, b in zip(offload_lm.master_shards(opt), offload_lm.master_shards(ref_opt), strict=True)
    ]
    found["exact"] = losses == ref_losses and all(same)
    # a model a ZeRO-3 boost emptied is refused by name, not read out of bounds
    try:
        tessera.boost(model, offload_lm.optimizer(model), valid)
        found["boosted twice"] = None
    except ValueError as e:
        found["boosted twice"] = str(e)
    return found


def _tp_case() -> dict:
    """tp=2 on GPT-2 (tied head): two refused plans, then Tessera's own plan."""
    own = plan_for(tiny_gpt2())
    refusals = {
        # lm_head split by its input features, the tied embedding by vocabulary rows
        "ties": TPPlan(family="gpt2", layers={**own.layers, "lm_head": "rowwise"}, prepare=own.prepare),
        # refused after GPT-2's Conv1D -> Linear layout change (which used to stay behind)
        "style": TPPlan(
            family="gpt2", layers={**own.layers, "transformer.h.*.mlp.c_fc": "fancy"}, prepare=own.prepare
        ),
    }
    plan = tessera.Plan(tp=2, max_grad_norm=0.5)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    found = {name: _refused(model, opt, plan, tp_plan) for name, tp_plan in refusals.items()}
    model, opt = tessera.boost(model, opt, plan)
    ref = tiny_gpt2()
    ref, ref_opt = tessera.boost(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), plan)
    steps = _batches()
    losses = [opt.train_step(b, causal_lm_loss)["loss"] for b in steps]
    ref_losses = [ref_opt.train_step(b, causal_lm_loss)["loss"] for b in steps]
    same = [
        torch.equal(
            a.full_tensor() if hasattr(a, "full_tensor") else a,
            b.full_tensor() if hasattr(b, "full_tensor") else b,
        )
        for a, b in zip(model.parameters(), ref.parameters(), strict=True)
    ]
    found["exact"] = losses == ref_losses and all(same)
    return found


def _pp_case() -> dict:
    """pp=2 on GPT-2's 2 layers: stage counts that do not sum to 2, then an even split."""
    refused = tessera.Plan(pp=2, stage_layers=(1, 2), activation_checkpointing=True)
    plan = tessera.Plan(pp=2, activation_checkpointing=True)
    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    found = {"stages": _refused(model, opt, refused)}
    model, opt = tessera.boost(model, opt, plan)
    ref = tiny_gpt2()
    ref, ref_opt = tessera.boost(ref, torch.optim.SGD(ref.parameters(), lr=0.5), plan)
    steps = _batches()
    losses = [opt.train_step(b, causal_lm_loss)["loss"] for b in steps]
    ref_losses = [ref_opt.train_step(b, causal_lm_loss)["loss"] for b in steps]
    same = [
        torch.equal(a, b) for a, b in zip(opt.trainer.parameters(), ref_opt.trainer.parameters(), strict=True)
    ]
    found["exact"] = losses == ref_losses and all(same)
    return found


def _two_ranks(tmp: Path) -> dict:
    rank = torch.distributed.get_rank()
    return {
        "offload": _offload_case(tmp / f"r{rank}"),
        "tp": _tp_case(),
        "pp": _pp_case(),
    }


def _one_line(message: str | None, pattern: str) -> bool:
    import re

    return message is not None and "\n" not in message and re.search(pattern, message) is not None


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("refusal")
    for rank in (0, 1):
        (tmp / f"r{rank}").mkdir()
    return spawn(_two_ranks, 2, tmp, timeout_s=300)


def test_a_refused_offload_plan_leaves_the_model_as_given_and_the_advised_boost_trains_exactly(ranks):
    for found in ranks:
        off = found["offload"]
        patterns = {
            "budget": r"^Plan\.host_memory=1000 bytes is below what the largest chunk needs .*\(\d+ bytes",
            "directory": r"^Plan\.offload_dir=.* is not a writable directory",
            "chunk": r"^Plan\.chunk_mib=0\.001 holds 263 fp32 elements, below the largest parameter",
        }
        for name, pattern in patterns.items():
            message, diffs = off[name]
            assert _one_line(message, pattern), (name, message)
            assert diffs == [], (name, diffs)
        assert off["no directory left"]  # the budget is refused before the directory is made
        assert off["exact"]
        assert _one_line(off["boosted twice"], r"^parameter \S+ has no storage .* boost a freshly built"), (
            off["boosted twice"]
        )


def test_a_refused_tensor_parallel_plan_leaves_the_model_as_given(ranks):
    for found in ranks:
        tp = found["tp"]
        message, diffs = tp["ties"]
        assert _one_line(message, r"^tied parameter 'weight' of \w+ is split as .* but its tie"), message
        assert diffs == [], diffs
        message, diffs = tp["style"]
        assert _one_line(message, r"^unknown tensor parallel style 'fancy'"), message
        assert diffs == [], diffs
        assert tp["exact"]


def test_refused_pipeline_stages_leave_the_model_as_given(ranks):
    for found in ranks:
        message, diffs = found["pp"]["stages"]
        assert _one_line(message, r"^stage layer counts \(1, 2\) must be 2 positive numbers summing to 2"), (
            message
        )
        assert diffs == [], diffs
        assert found["pp"]["exact"]


def test_a_model_deepcopy_cannot_copy_is_checked_when_applied_with_a_warning(caplog):
    import threading

    from tessera.train import boost as boost_module

    model = tiny_gpt2()
    model.lock = threading.Lock()  # deepcopy refuses it, so no meta copy can be checked first
    with caplog.at_level("WARNING", logger="tessera.train.boost"):
        names = boost_module._check_tp(model, plan_for(model), None, tessera.Plan(tp=2))
    assert names == {n for n, _ in model.named_parameters()}  # the stricter state check
    assert "cannot copy GPT2LMHeadModel to check its tensor parallel plan before changing it" in caplog.text
