"""Fidelity of the stale-K/V methods on the trained digits DiT, for `tessera bench dit`.

Each PipeFusion / DistriFusion layout (warm-up 0, 1, 2) samples 100 digits on 2 ranks from
the same noise as exact serial sampling. Reported per layout: PSNR against serial (one MSE
over all samples, and the mean of per-sample PSNRs), the class accuracy an independent
classifier gives the samples, and the distance to the plain single-process reference of
the method's own semantics (`tessera.diffusion.stale_reference`), which must be float32
rounding. The reference also records the latent after every step, so the JSON holds how
the error against serial sampling grows step by step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_sample
from tessera.diffusion.sampler import initial_noise
from tessera.diffusion.stale_reference import stale_reference_denoise
from tessera.diffusion.stepper import FlowStepper
from tessera.runtime import spawn

STEPS, GUIDANCE = 20, 2.0
PATCHES = 4  # the digits DiT has 4 token rows: one per patch


def fidelity_layouts() -> dict[str, ParallelConfig]:
    layouts = {}
    for warm in (0, 1, 2):
        layouts[f"pipefusion_warmup{warm}"] = ParallelConfig(pipefusion=2, patches=PATCHES, warmup_steps=warm)
        layouts[f"distrifusion_warmup{warm}"] = ParallelConfig(distrifusion=2, warmup_steps=warm)
    return layouts


def _load(model_dir: str):
    from tessera.train.checkpoint import load_dit

    return load_dit(model_dir)


def _sample_rank(model_dir: str, labels: torch.Tensor, layouts: dict[str, ParallelConfig]) -> dict:
    model = _load(model_dir)
    size = model.config.image_size
    kw = dict(height=size, width=size, num_steps=STEPS, guidance_scale=GUIDANCE, seed=0)
    return {name: parallel_sample(model, labels, config=config, **kw) for name, config in layouts.items()}


class RecordingStepper(FlowStepper):
    """Flow-matching Euler that keeps the latent after every step (parts joined in order)."""

    def __init__(self, num_steps: int):
        super().__init__(num_steps)
        self.parts: dict[int, dict] = {}

    def step(self, key, step, x, model_out):
        out = super().step(key, step, x, model_out)
        self.parts.setdefault(step, {})[key] = out
        return out

    def trajectory(self) -> list[torch.Tensor]:
        return [
            torch.cat([parts[k] for k in sorted(parts)], dim=2) for _, parts in sorted(self.parts.items())
        ]


def _reference(
    model, labels: torch.Tensor, config: ParallelConfig
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    size = model.config.image_size
    stepper = RecordingStepper(STEPS)
    latent = stale_reference_denoise(
        model,
        config=config,
        cond={"labels": labels},
        uncond={"labels": torch.full_like(labels, model.null_class)},
        guidance_scale=GUIDANCE,
        stepper=stepper,
        noise=initial_noise((labels.shape[0], model.config.in_channels, size, size), 0),
    )
    return latent, stepper.trajectory()


def psnr(x: torch.Tensor, reference: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB for images in [-1, 1] (peak-to-peak 2)."""
    mse = ((x.clamp(-1, 1) - reference.clamp(-1, 1)) ** 2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(4.0 / mse)).item()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def run_fidelity(model_dir: Path, *, per_digit: int) -> list[dict]:
    from tessera.data.digits import digit_classifier

    labels = torch.arange(10).repeat_interleave(per_digit)
    layouts = fidelity_layouts()
    serial = spawn(_sample_rank, 1, str(model_dir), labels, {"serial": ParallelConfig()})[0]["serial"]
    outputs = spawn(_sample_rank, 2, str(model_dir), labels, layouts)[0]
    model = _load(str(model_dir))
    exact_latent, exact_path = _reference(model, labels, ParallelConfig(patches=PATCHES, warmup_steps=STEPS))
    assert _relative(exact_latent, serial) < 1e-5, "the reference with full warm-up is serial sampling"
    clf = digit_classifier()
    rows = [_row("serial", serial, serial, serial, labels, clf, [0.0] * STEPS)]
    for name, config in layouts.items():
        reference, path = _reference(model, labels, config)
        errors = [_relative(a, b) for a, b in zip(path, exact_path, strict=True)]
        rows.append(_row(name, outputs[name], reference, serial, labels, clf, errors))
    return rows


def _row(name, images, reference, serial, labels, clf, errors) -> dict:
    per_sample = [psnr(images[i], serial[i]) for i in range(len(labels))]
    finite = [p for p in per_sample if p != float("inf")]
    return {
        "method": name,
        "psnr_db": round(psnr(images, serial), 2),
        "mean_sample_psnr_db": round(sum(finite) / len(finite), 2) if finite else float("inf"),
        "class_accuracy": clf.accuracy(images, labels),
        "rel_diff_vs_reference": _relative(images, reference),
        "final_rel_error_vs_serial": _relative(images, serial) if name != "serial" else 0.0,
        "samples": len(labels),
        "steps": STEPS,
        "trajectory_rel_error": [round(e, 5) for e in errors],
    }
