"""DiT inference under tensor parallel runs on the training plan (tessera.parallel.tp_plans.DIT,
DTensor): each rank holds only its shard while sampling, the model is whole again after,
a model sharded beforehand stays sharded, the latents equal serial sampling and the bytes
counted equal tessera.diffusion.comm_bytes' formula for tp (S*L*2*T*Bm*n*h*e)."""

import gc
import weakref

import torch
from parity import perturbed

from tessera.diffusion.adapters import adapter_for
from tessera.diffusion.comm_bytes import Dims, formula_bytes
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_sample
from tessera.diffusion.sampler import sample
from tessera.diffusion.tensor_parallel import is_tp_sharded, tensor_parallel
from tessera.models.dit import DiT, DiTConfig
from tessera.parallel.tp_plans import apply_tp, plan_for
from tessera.runtime import spawn

STEPS, GUIDANCE, SEED, HEIGHT, WIDTH = 3, 2.0, 7, 16, 12
LABELS = torch.tensor([1, 4])
CONFIG = ParallelConfig(tp=2)
# attention q/k/v (weights and biases), its output projection's weight, the MLP's fc1 and fc2
# weight: split; the row-parallel biases (added once, after the all-reduce) and the rest: whole
SPLIT = ("attn.to_q.", "attn.to_k.", "attn.to_v.", "attn.to_out.weight", "mlp.fc1.", "mlp.fc2.weight")


def _dit() -> DiT:
    torch.manual_seed(0)
    config = DiTConfig(image_size=16, patch_size=2, hidden_size=32, depth=2, num_heads=4, num_classes=5)
    return perturbed(DiT(config), 0.2)


def _sample(model, mesh):
    return parallel_sample(
        model,
        LABELS,
        config=CONFIG,
        mesh=mesh,
        height=HEIGHT,
        width=WIDTH,
        num_steps=STEPS,
        guidance_scale=GUIDANCE,
        seed=SEED,
    )


def _held(model) -> dict[str, tuple[int, int, int]]:
    """Per parameter: whole elements, this rank's elements, elements its storage holds."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = (p.numel(), local.numel(), local.untyped_storage().nbytes() // local.element_size())
    return out


def _worker():
    model, mesh = _dit(), CONFIG.build_mesh()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    original = weakref.ref(model.blocks[0].attn.to_q.weight)
    with tensor_parallel(adapter_for(model), mesh):
        gc.collect()
        inside = dict(held=_held(model), released=original() is None, heads=model.blocks[0].attn.num_heads)
    after = dict(model.named_parameters())
    whole = all(torch.equal(after[n], t) and not hasattr(after[n], "placements") for n, t in start.items())
    heads = model.blocks[0].attn.num_heads
    mesh.comm.ledger.reset()
    latent = _sample(model, mesh)  # shards and gathers inside
    counted = mesh.comm.ledger.snapshot()
    apply_tp(model, plan_for(model), mesh.device_mesh["tp"], 2)  # sharded once, before many runs
    mesh.comm.ledger.reset()
    latent_presharded = _sample(model, mesh)
    return dict(
        inside=inside,
        whole_after=whole,
        heads_after=heads,
        latents=(latent, latent_presharded),
        counted=(counted, mesh.comm.ledger.snapshot()),
        stays_sharded=is_tp_sharded(model),
    )


def test_inference_tensor_parallel_holds_shards_and_matches_serial():
    expected = sample(
        _dit(), LABELS, image_shape=(1, HEIGHT, WIDTH), num_steps=STEPS, guidance_scale=GUIDANCE, seed=SEED
    )
    dims = Dims(
        steps=STEPS, layers=2, tokens=8 * 6, hidden=32, batch=2, latent_elems=HEIGHT * WIDTH, guidance=True
    )
    formula = formula_bytes(CONFIG, dims)
    results = spawn(_worker, 2, timeout_s=300)
    for r in results:
        assert r["inside"]["released"]  # the whole weight is gone while sharded ...
        assert r["inside"]["heads"] == 2  # ... attention reshapes to its 2 local heads
        for name, (numel, local, stored) in r["inside"]["held"].items():
            split = any(key in name for key in SPLIT)
            assert local == (numel // 2 if split else numel), name
            assert stored == local, name  # the shard is not a view into the whole tensor
        assert r["whole_after"] and r["heads_after"] == 4
        assert r["stays_sharded"]
        for latent in r["latents"]:
            # same math, the attention and MLP sums split over 2 ranks: float32 rounding
            # (~1e-7 relative) amplified by 3 Euler steps and a guidance scale of 2
            torch.testing.assert_close(latent, expected, rtol=1e-4, atol=1e-5)
        for counted in r["counted"]:
            assert counted.keys() == {"all_reduce@tp"}, counted
    # the formula sums over all ranks
    assert sum(r["counted"][0]["all_reduce@tp"]["bytes"] for r in results) == formula
    assert sum(r["counted"][1]["all_reduce@tp"]["bytes"] for r in results) == formula
