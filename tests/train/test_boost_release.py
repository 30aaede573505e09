"""A boosted model is freed once its user drops it: nothing Tessera installs keeps it alive.

A parameter's gradient hook lives on autograd's C++ side, out of the garbage collector's
sight, so a hook bound to the engine (which holds the model, which holds the parameter)
made a cycle the collector could not break: every model boosted in a process stayed, with
its memory (found on a GPU, where a second boosted model's device memory counted the
first's). The collector runs once after the references are dropped; the models are
reachable only through cycles by then."""

import gc
import weakref

import torch
from tiny_lm import tiny_gpt2
from tiny_moe import tiny_moe

import tessera
from tessera.runtime import spawn
from tessera.train.losses import causal_lm_loss


def _still_alive(family: str, plan) -> tuple[bool, bool]:
    """Boost a tiny model under ``plan``, take one step, drop it and collect: whether the
    model and the optimizer are still alive."""
    tokens = torch.randint(0, 128, (8, 12), generator=torch.Generator().manual_seed(0))
    model = tiny_gpt2() if family == "gpt2" else tiny_moe(family)
    model, optimizer = tessera.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan)
    optimizer.train_step(tokens, causal_lm_loss)
    model_ref, optimizer_ref = weakref.ref(model), weakref.ref(optimizer)
    del model, optimizer
    gc.collect()
    return model_ref() is not None, optimizer_ref() is not None


def _one_rank_plans_dropped(folder: str) -> dict:
    plans = {
        "zero0": tessera.Plan(),
        "zero3": tessera.Plan(zero=3, chunk_mib=0.016),
        "zero3_offload": tessera.Plan(
            zero=3, chunk_mib=0.016, offload="auto", host_memory=120_000, offload_dir=f"{folder}/offload"
        ),
    }
    return {name: _still_alive("gpt2", plan) for name, plan in plans.items()}


def test_a_dropped_boosted_model_is_freed(tmp_path):
    alive = spawn(_one_rank_plans_dropped, 1, str(tmp_path), backend="gloo")[0]
    assert alive == {name: (False, False) for name in alive}, alive


def _parallel_plans_dropped() -> dict:
    """The same on 2 ranks for the plans that install hooks or wrappers of their own."""
    plans = {
        "tp2": ("gpt2", tessera.Plan(tp=2)),
        "sp2": ("gpt2", tessera.Plan(sp=2)),
        "pp2": ("gpt2", tessera.Plan(pp=2, microbatches=2)),
        "ep2": ("mixtral", tessera.Plan(dp=2, ep=2, zero=3, chunk_mib=0.01)),
    }
    return {name: _still_alive(family, plan) for name, (family, plan) in plans.items()}


def test_dropped_models_under_parallel_plans_are_freed():
    alive = spawn(_parallel_plans_dropped, 2, backend="gloo")[0]
    assert alive == {name: (False, False) for name in alive}, alive
