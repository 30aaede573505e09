"""The digits-dit recipe's data-parallel training (boost at ZeRO stage 0) on 2 gloo ranks
against one process on the same global batches, and its bit-exact resume."""

import tempfile
from pathlib import Path

import torch

import tessera
from tessera.models.dit import DiTConfig
from tessera.runtime import Mesh, spawn
from tessera.train import digits_dit as recipe_mod
from tessera.train.checkpoint import load_tensors

TINY = recipe_mod.DigitsDiTRecipe(
    model=DiTConfig(image_size=8, patch_size=2, hidden_size=32, depth=2, num_heads=2),
    steps=4,
    batch_size=16,
    warmup_steps=1,
    checkpoint_every=2,
    log_every=1,
)
STEPS = 4


def _run_steps(mesh: Mesh) -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Losses (averaged over dp), gradients after each step, final parameters."""
    images, labels = recipe_mod.load_digits_images()
    model, _, optimizer = recipe_mod.build(TINY)
    model, boosted = tessera.boost(model, optimizer, tessera.Plan(dp=mesh.size("dp")), mesh)
    losses, grads = [], []
    for step in range(STEPS):
        batch = recipe_mod.global_batch(TINY, step, images, labels)
        losses.append(recipe_mod.train_step(boosted, batch, recipe_mod.learning_rate(TINY, step)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _resume_runs(root: str) -> dict[str, dict[str, torch.Tensor]]:
    mesh = Mesh(dp=2)
    straight, halves = Path(root, "straight"), Path(root, "halves")
    recipe_mod.train(TINY, mesh, straight, progress=False)
    first = recipe_mod.DigitsDiTRecipe(**{**TINY.__dict__, "steps": 2})
    recipe_mod.train(first, mesh, halves, progress=False)
    recipe_mod.train(TINY, mesh, halves, resume=True, progress=False)
    torch.distributed.barrier()
    out = {}
    for name in ("straight", "halves"):
        out[name] = load_tensors(Path(root, name, "model.safetensors")) | load_tensors(
            Path(root, name, "train_state.safetensors")
        )
    return out


def _ddp_checks(root: str) -> dict:
    steps = _run_steps(Mesh(dp=2))
    resume = _resume_runs(root)  # every rank trains; rank 0 wrote the files
    return {"steps": steps, "resume": resume if torch.distributed.get_rank() == 0 else None}


def test_ddp_matches_single_process_and_resumes_bit_exact():
    reference_losses, reference_grads, reference_params = _run_steps(Mesh(dp=1))
    with tempfile.TemporaryDirectory() as root:
        ranks = spawn(_ddp_checks, 2, root, timeout_s=300)
    for losses, grads, params in (r["steps"] for r in ranks):
        # Each rank averages 8 samples and the ranks then average the two means; the
        # reference averages 16 at once. Only float32 summation order differs: ~1e-7
        # relative per reduction, so 1e-5 leaves two orders of margin over 4 steps.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-5, atol=1e-7)
        for step in range(STEPS):
            for name, g in grads[step].items():
                # Gradients: same reduction-order argument; absolute floor for near-zero entries.
                torch.testing.assert_close(g, reference_grads[step][name], rtol=1e-4, atol=1e-6, msg=name)
        for name, p in params.items():
            # Adam divides by sqrt(v): tiny gradient differences can move a weight by up to
            # ~lr * 1e-4 per step; 4 steps at lr 1e-3 stay well below 1e-5.
            torch.testing.assert_close(p, reference_params[name], rtol=1e-5, atol=1e-5, msg=name)
    # Resume: the same data and arithmetic in the same order, so equal to the bit.
    resume = ranks[0]["resume"]
    assert resume["straight"].keys() == resume["halves"].keys()
    for name, tensor in resume["straight"].items():
        assert torch.equal(tensor, resume["halves"][name]), name
