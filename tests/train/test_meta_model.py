"""A model built on the meta device (accelerate.init_empty_weights) is made chunk by chunk by
boost's ZeRO core (tessera.train.meta_model, tessera.memory.materialize): set-up never holds
the whole model, every rank starts from dp-rank 0's initialisation, and training is the
training of the same model built whole. With an init that gives each parameter the same
values however it is called, the comparison is exact (torch.equal, ==): the same values go
through the same arithmetic."""

import dataclasses

import accelerate
import pytest
import torch
from tiny_lm import SEQ, VOCAB, tiny_gpt2
from torch import nn

import tessera
from tessera.memory.chunk_manager import ChunkManager
from tessera.memory.materialize import materialized
from tessera.runtime import spawn
from tessera.train.losses import causal_lm_loss
from tessera.train.meta_model import empty_parameters


def _meta_gpt2() -> nn.Module:
    with accelerate.init_empty_weights():
        model = tiny_gpt2()
    model.tie_weights()  # as accelerate's docs do after init_empty_weights: lm_head is the embedding
    return model


def _keyed_init(model: nn.Module, offset: float = 0.0):
    """Each own parameter filled from a generator seeded by its module's name: the same values
    whichever order modules are called in (``offset``: a rank's own, undone by the broadcast)."""
    names = {m: n for n, m in model.named_modules()}

    def init(module):
        for i, (name, p) in enumerate(module.named_parameters(recurse=False)):
            g = torch.Generator().manual_seed(sum(map(ord, f"{names[module]}.{name}")) * 31 + i)
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + offset)

    return init


def _batches(n=3):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (8, SEQ), generator=g) for _ in range(n)]


def _train(model, plan, init=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    model, opt = tessera.boost(model, opt, plan, init=init)
    losses = [opt.train_step(b, causal_lm_loss)["loss"] for b in _batches()]
    opt.engine.gather_all() if opt.engine.zero == 3 else None
    with opt.engine.resident():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params


def _worker(plans):
    rank = torch.distributed.get_rank()
    out = []
    for plan in plans:
        whole = tiny_gpt2()
        with torch.no_grad():
            whole.apply(_keyed_init(whole))
        ref = _train(whole, plan)
        meta = _meta_gpt2()
        got = _train(meta, plan, init=_keyed_init(meta, offset=float(rank)))  # rank 1's own values differ
        out.append((ref, got))
    return out


def test_a_meta_model_trains_as_the_same_model_built_whole(tmp_path):
    base = tessera.Plan(dp=2, chunk_mib=0.016, block_chunks=True, max_grad_norm=0.5)
    plans = [dataclasses.replace(base, zero=z) for z in (1, 2, 3)]
    plans.append(
        dataclasses.replace(base, zero=3, offload="auto", host_memory=200_000, offload_dir=str(tmp_path))
    )
    for rank_result in spawn(_worker, 2, plans):
        for plan, ((ref_losses, ref_params), (losses, params)) in zip(plans, rank_result, strict=True):
            assert losses == ref_losses, (plan.zero, plan.offload, losses, ref_losses)
            for name, value in ref_params.items():
                assert torch.equal(params[name], value), (plan.zero, plan.offload, name)


def test_the_default_init_is_the_models_own():
    """transformers' GPT-2 init, module by module: N(0, 0.02) weights, the residual
    projections re-scaled from their attention and MLP modules to 0.02 / sqrt(2 x layers),
    layer norms 1, biases 0; the lm_head stays tied to the token embedding."""
    model = _meta_gpt2()
    model, opt = tessera.boost(
        model, torch.optim.AdamW(model.parameters()), tessera.Plan(zero=3, chunk_mib=0.016)
    )
    opt.engine.gather_all()
    block = model.transformer.h[0]
    # sample std of n normal values: relative standard error 1/sqrt(2n) <= 1.3% here (n >= 3072),
    # so +-10% cannot fail by chance and fails for any other std the init could have used
    for w, std in (
        (block.attn.c_attn.weight, 0.02),
        (block.mlp.c_fc.weight, 0.02),
        (block.attn.c_proj.weight, 0.02 / 2),  # 2 layers: 0.02 / sqrt(4)
        (block.mlp.c_proj.weight, 0.02 / 2),
        (model.transformer.wte.weight, 0.02),
    ):
        assert abs(float(w.detach().std()) - std) < 0.1 * std, (float(w.detach().std()), std)
    assert torch.equal(block.ln_1.weight, torch.ones_like(block.ln_1.weight))
    assert torch.equal(block.attn.c_attn.bias, torch.zeros_like(block.attn.c_attn.bias))
    assert model.lm_head.weight is model.transformer.wte.weight


def test_chunks_are_made_one_block_at_a_time():
    """Chunks smaller than a block (each block spans several): at most one block's chunks and
    one more are real at once, never the model, and every module with parameters of its own
    is initialised exactly once."""
    model = _meta_gpt2()
    segments = {p: i for i, block in enumerate(model.transformer.h) for p in block.parameters()}
    empty_parameters(model, torch.device("cpu"))
    params = list(model.parameters())
    manager = ChunkManager([{"params": params}], chunk_elems=4200, align=1, segment_of=segments, lazy=True)
    per_block = max(len({manager.owner[p] for p in block.parameters()}) for block in model.transformer.h)
    calls: dict[nn.Module, int] = {}

    def init(module):
        calls[module] = calls.get(module, 0) + 1

    most = 0
    for cg in materialized(manager, model, init):
        most = max(most, sum(c.resident and c.chunk.buffer.device.type != "meta" for c in manager.chunks))
        cg.free()
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    assert all(calls.get(m) == 1 for m in owners), calls
    assert calls.get(model.transformer.h[0].attn) == 1  # a block's own modules too (GPT-2's c_proj scaling)
    assert model not in calls and model.transformer.h not in calls  # not the containers of the blocks
    # measured: 10 chunks, a block spans 5 of them, at most 5 real at once
    assert most <= per_block + 1 < len(manager.chunks), (len(manager.chunks), per_block, most)


@pytest.mark.parametrize(
    "case,match",
    [
        ("partial", "is on the meta device and .* is not"),
        ("untied", r"call model.tie_weights\(\) before building the optimizer"),
        ("zero0", r"Plan\(zero=1..3\) with data parallelism only, not Plan\(zero=0\)"),
        ("frozen", "is on the meta device and frozen"),
        ("no_reset", "module weird has parameters on the meta device and no reset_parameters"),
        ("init_real", r"boost\(init=...\) initialises a model built on the meta device"),
    ],
)
def test_what_cannot_be_made_is_refused_before_anything_changes(case, match):
    plan = tessera.Plan(zero=0 if case == "zero0" else 3)
    if case == "init_real":
        model = tiny_gpt2()
    elif case == "no_reset":

        class Weird(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(3))

        with accelerate.init_empty_weights():
            model = nn.Sequential()
            model.add_module("weird", Weird())
    else:
        model = _meta_gpt2()
        if case == "partial":
            model.transformer.wpe.weight = nn.Parameter(torch.zeros(SEQ, 32))
        if case == "untied":
            with accelerate.init_empty_weights():
                model = tiny_gpt2()
        if case == "frozen":
            model.transformer.ln_f.weight.requires_grad_(False)
    before = {n: p for n, p in model.named_parameters()}
    init = _keyed_init(model) if case == "init_real" else None
    with pytest.raises(ValueError, match=match):
        tessera.boost(model, torch.optim.AdamW(model.parameters()), plan, init=init)
    assert {n: p for n, p in model.named_parameters()} == before  # the same objects, untouched
