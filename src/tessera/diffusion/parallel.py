"""One entry point for every parallel inference layout: `parallel_denoise` for any
supported transformer and scheduler, and `parallel_sample` for Tessera's class-conditional
DiT with its flow-matching sampler."""

from __future__ import annotations

import torch

from tessera.diffusion.adapters import Adapter, adapter_for
from tessera.diffusion.band_parallel import DistriFusionKernel, USPKernel, band_denoise
from tessera.diffusion.guidance import Cond, Guidance
from tessera.diffusion.layout import ParallelConfig, stage_bounds
from tessera.diffusion.pipefusion import pipefusion_denoise, sub_bands
from tessera.diffusion.sampler import initial_noise
from tessera.diffusion.stepper import FlowStepper
from tessera.diffusion.tensor_parallel import check_tp, is_tp_sharded, tensor_parallel
from tessera.runtime.mesh import Mesh


def check_layout(adapter: Adapter, config: ParallelConfig, height: int, width: int) -> None:
    """Every mistake that would otherwise surface mid-run, named with its numbers."""
    adapter.check_size(height, width)
    rows = height // adapter.patch_size
    if adapter.num_heads % config.ulysses:
        raise ValueError(
            f"{adapter.num_heads} attention heads are not divisible by the Ulysses degree {config.ulysses}"
        )
    if adapter.num_heads % config.tp:
        raise ValueError(
            f"{adapter.num_heads} attention heads are not divisible by the TP degree {config.tp}"
        )
    # the plan's class, processors, norms and every split size; a model already sharded (split
    # once before many runs, as bench dit does) was checked when it was split, and its modules
    # now count their local heads
    if config.tp > 1 and not is_tp_sharded(adapter.model):
        check_tp(adapter.model, config.tp)
    if config.method == "pipefusion":
        stage_bounds(adapter.num_layers, config.pipefusion, config.stage_layers)
        sub_bands(rows, config.patches, config.sp, 0)
    if config.method != "tp":  # every other method swaps the attention kernel in
        adapter.check_attention()


def check_steps(config: ParallelConfig, num_steps: int) -> None:
    """Stale-activation methods need at least their synchronous warm-up steps."""
    if config.method in ("pipefusion", "distrifusion") and config.warmup_steps > num_steps:
        raise ValueError(
            f"warmup_steps {config.warmup_steps} exceeds the {num_steps} sampling steps; "
            f"use at most {num_steps} (warm-up = all steps is exact)"
        )


def parallel_denoise(
    model: torch.nn.Module,
    *,
    cond: Cond,
    uncond: Cond | None,
    guidance_scale: float,
    stepper,
    noise: torch.Tensor,
    config: ParallelConfig,
    mesh: Mesh | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Run the denoising loop of ``stepper`` from ``noise`` (B, C, H, W), spread over the
    ranks as ``config`` says. Every rank returns the final latent."""
    adapter = adapter_for(model)
    height, width = noise.shape[2:]
    check_layout(adapter, config, height, width)
    for branch in (cond, uncond) if uncond is not None else (cond,):
        adapter.check_cond(branch)
    check_steps(config, stepper.num_steps)
    mesh = mesh or config.build_mesh()
    guidance = Guidance(cond, uncond, guidance_scale, mesh)
    common = dict(guidance=guidance, stepper=stepper, noise=noise, mesh=mesh, progress=progress)
    if config.method == "pipefusion":
        return pipefusion_denoise(adapter, config=config, **common)
    if config.method == "distrifusion":
        kernel = DistriFusionKernel(mesh, config.warmup_steps)
        return band_denoise(adapter, band_axes=("distrifusion",), kernel=kernel, **common)
    if config.method == "tp":
        with tensor_parallel(adapter, mesh):
            return band_denoise(adapter, band_axes=(), kernel=None, **common)
    return band_denoise(adapter, band_axes=("ring", "ulysses"), kernel=USPKernel(mesh), **common)


def parallel_sample(
    model: torch.nn.Module,
    labels: torch.Tensor,
    *,
    config: ParallelConfig,
    mesh: Mesh | None = None,
    height: int,
    width: int,
    num_steps: int,
    guidance_scale: float = 1.0,
    seed: int = 0,
    progress: bool = False,
) -> torch.Tensor:
    """Like :func:`tessera.diffusion.sampler.sample` for Tessera's DiT, spread over the
    ranks as ``config`` says. Every rank returns the final latent (B, C, H, W)."""
    adapter = adapter_for(model)
    check_layout(adapter, config, height, width)
    param = next(model.parameters())
    labels = labels.to(param.device)
    noise = initial_noise(
        (labels.shape[0], adapter.in_channels, height, width), seed, param.device, param.dtype
    )
    null = torch.full_like(labels, adapter.null_class)
    return parallel_denoise(
        model,
        cond={"labels": labels},
        uncond={"labels": null},
        guidance_scale=guidance_scale,
        stepper=FlowStepper(num_steps),
        noise=noise,
        config=config,
        mesh=mesh,
        progress=progress,
    )
