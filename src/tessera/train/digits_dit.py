"""Recipe `digits-dit`: a small class-conditional DiT on scikit-learn's 8x8 digits,
trained with flow matching, data parallel over the mesh's ``dp`` axis (``tessera.boost``
at ZeRO stage 0: gradients averaged chunk by chunk as backward produces them).

Every random draw of step ``s`` (which images, their noise, times and label drop-out) comes
from a generator seeded by (seed, s) and is drawn for the *global* batch, of which each dp
rank takes its slice. So a run on N ranks sees exactly the data of the 1-rank run, and
resuming at step s needs no saved RNG state: both make the parity tests exact.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from tessera.data.digits import load_digits_images
from tessera.models.dit import DiT, DiTConfig
from tessera.runtime.mesh import Mesh
from tessera.train import checkpoint as ckpt
from tessera.train.boost import boost
from tessera.train.boosted import BoostedOptimizer
from tessera.train.optim_state import optimizer_from_tensors, optimizer_to_tensors
from tessera.train.plan import Plan

log = logging.getLogger(__name__)

RECIPE_NAME = "digits-dit"


def _default_model() -> DiTConfig:
    # 2x2 patches: 16 tokens per 8x8 digit keep a training step near 0.1 s on one core.
    return DiTConfig(image_size=8, in_channels=1, patch_size=2, hidden_size=128, depth=4, num_heads=4)


@dataclass(frozen=True, kw_only=True)
class DigitsDiTRecipe:
    model: DiTConfig = field(default_factory=_default_model)
    steps: int = 1500
    batch_size: int = 128  # global: split evenly over the dp ranks
    lr: float = 1e-3
    warmup_steps: int = 100
    ema_decay: float = 0.995
    label_dropout: float = 0.1  # trains the null class used by classifier-free guidance
    seed: int = 0
    checkpoint_every: int = 500
    log_every: int = 25

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"recipe {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.label_dropout < 1.0:
            raise ValueError(f"label_dropout must be in [0, 1), got {self.label_dropout}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DigitsDiTRecipe:
        data = dict(data)
        data["model"] = DiTConfig.from_dict(data["model"])
        return cls(**data)


def global_batch(recipe: DigitsDiTRecipe, step: int, images: torch.Tensor, labels: torch.Tensor):
    """(x_t, t, y, target velocity) of the whole global batch of ``step``."""
    g = torch.Generator().manual_seed(recipe.seed * 1_000_003 + step)
    n = recipe.batch_size
    idx = torch.randint(len(images), (n,), generator=g)
    noise = torch.randn((n, *images.shape[1:]), generator=g)
    t = torch.rand(n, generator=g)
    drop = torch.rand(n, generator=g) < recipe.label_dropout
    x0 = images[idx]
    y = torch.where(drop, torch.full_like(labels[idx], recipe.model.num_classes), labels[idx])
    tt = t[:, None, None, None]
    return (1 - tt) * x0 + tt * noise, t, y, noise - x0


def learning_rate(recipe: DigitsDiTRecipe, step: int) -> float:
    return recipe.lr * min(1.0, (step + 1) / max(1, recipe.warmup_steps))


def build(recipe: DigitsDiTRecipe) -> tuple[DiT, DiT, torch.optim.Optimizer]:
    torch.manual_seed(recipe.seed)  # same initial weights on every rank
    model = DiT(recipe.model)
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.99), weight_decay=0.0)
    return model, ema, optimizer


def flow_matching_loss(model: DiT, batch) -> torch.Tensor:
    x_t, t, y, target = batch
    return F.mse_loss(model(x_t, t, y), target)


def train_step(optimizer: BoostedOptimizer, batch, lr: float) -> float:
    """One step on the global ``batch`` (each dp rank takes its share); the loss averaged over dp."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    return optimizer.train_step(batch, flow_matching_loss)["loss"]


def save(
    out_dir: Path, recipe: DigitsDiTRecipe, model: DiT, ema: DiT, optimizer, step: int, plan: Plan
) -> None:
    opt_tensors, opt_meta = optimizer_to_tensors(optimizer)
    train_tensors = {f"model.{k}": v for k, v in model.state_dict().items()} | opt_tensors
    ckpt.save_checkpoint(
        out_dir,
        config={"model": recipe.model.to_dict(), "recipe": recipe.to_dict(), "recipe_name": RECIPE_NAME},
        weights=ema.state_dict(),
        train_tensors=train_tensors,
        train_meta={"step": step, "optimizer": opt_meta, "plan": plan.to_dict()},
    )


def restore(out_dir: Path, model: DiT, ema: DiT, optimizer) -> int:
    """Load a checkpoint written by :func:`save`; returns the step to continue from."""
    meta = ckpt.read_train_meta(out_dir)
    tensors = ckpt.load_tensors(out_dir / "train_state.safetensors")
    prefix = "model."
    model_tensors = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    ckpt.load_weights_into(model, model_tensors, out_dir / "train_state.safetensors")
    ckpt.load_weights_into(
        ema, ckpt.load_tensors(out_dir / "model.safetensors"), out_dir / "model.safetensors"
    )
    optimizer_from_tensors(optimizer, tensors, meta["optimizer"])
    return int(meta["step"])


def check_resume_recipe(out_dir: Path, recipe: DigitsDiTRecipe) -> None:
    saved = DigitsDiTRecipe.from_dict(ckpt.read_config(out_dir)["recipe"])
    mismatched = [
        k
        for k in ("model", "batch_size", "lr", "warmup_steps", "ema_decay", "label_dropout", "seed")
        if getattr(saved, k) != getattr(recipe, k)
    ]
    if mismatched:
        was = [getattr(saved, k) for k in mismatched]
        now = [getattr(recipe, k) for k in mismatched]
        raise ValueError(
            f"cannot resume {out_dir}: the recipe differs in {mismatched} (saved {was}, now {now})"
        )


def train(
    recipe: DigitsDiTRecipe, mesh: Mesh, out_dir: str | Path, *, resume: bool = False, progress: bool = True
) -> dict:
    """Train to ``recipe.steps``; returns a summary (final loss, seconds, steps run)."""
    out_dir = Path(out_dir)
    dp = mesh.size("dp")
    if recipe.batch_size % dp:
        raise ValueError(f"batch_size {recipe.batch_size} is not divisible by dp={dp}")
    images, labels = load_digits_images()
    model, ema, optimizer = build(recipe)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = 0
    if resume:
        check_resume_recipe(out_dir, recipe)
        start = restore(out_dir, model, ema, optimizer)  # boost keeps the loaded optimizer state
    plan = Plan(dp=dp)
    model, boosted = boost(model, optimizer, plan, mesh)
    is_logger = mesh.global_rank == 0
    bar = tqdm(
        total=recipe.steps, initial=start, desc="train digits-dit", disable=not (progress and is_logger)
    )
    loss_log = out_dir.with_name(out_dir.name + ".train_log.jsonl")
    if resume and is_logger:  # the log goes on: mark where, and under which plan
        with loss_log.open("a") as f:
            f.write(json.dumps({"resumed_from": start, "plan": plan.to_dict()}) + "\n")
    began, loss_value = time.perf_counter(), float("nan")
    for step in range(start, recipe.steps):
        loss = train_step(boosted, global_batch(recipe, step, images, labels), learning_rate(recipe, step))
        torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1.0 - recipe.ema_decay)
        done = step + 1
        if done % recipe.log_every == 0 or done == recipe.steps:
            loss_value = loss
            bar.set_postfix(loss=f"{loss_value:.4f}")
            if is_logger:
                with loss_log.open("a") as f:
                    f.write(
                        json.dumps({"step": done, "loss": loss_value, "lr": learning_rate(recipe, step)})
                        + "\n"
                    )
        if done % recipe.checkpoint_every == 0 or done == recipe.steps:
            if is_logger:
                save(out_dir, recipe, model, ema, boosted.inner, done, plan)
            mesh.comm.barrier()
        bar.update(1)
    bar.close()
    seconds = time.perf_counter() - began
    log.info("trained %d steps in %.1fs, final loss %.4f", recipe.steps - start, seconds, loss_value)
    return {
        "final_loss": loss_value,
        "seconds": seconds,
        "steps_run": recipe.steps - start,
        "out_dir": str(out_dir),
    }
