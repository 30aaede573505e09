"""`parallel_sample`: one entry point for every parallel inference layout of a DiT."""

from __future__ import annotations

import torch

from tessera.diffusion.adapter import DiTAdapter
from tessera.diffusion.band_parallel import DistriFusionKernel, USPKernel, band_sample
from tessera.diffusion.layout import ParallelConfig, split_rows, stage_bounds
from tessera.diffusion.pipefusion import pipefusion_sample
from tessera.diffusion.tensor_parallel import tensor_parallel
from tessera.runtime.mesh import Mesh


def check_layout(adapter: DiTAdapter, config: ParallelConfig, height: int, width: int) -> None:
    """Every mistake that would otherwise surface mid-run, named with its numbers."""
    adapter.check_size(height, width)
    rows = height // adapter.patch_size
    if adapter.num_heads % config.ulysses_degree:
        raise ValueError(
            f"{adapter.num_heads} attention heads are not divisible by the Ulysses degree {config.ulysses_degree}"
        )
    if adapter.num_heads % config.tp_degree:
        raise ValueError(
            f"{adapter.num_heads} attention heads are not divisible by the TP degree {config.tp_degree}"
        )
    if config.method == "pipefusion":
        stage_bounds(adapter.num_layers, config.pipefusion_degree, config.stage_layers)
        split_rows(rows, config.patches)


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
    """Sample like :func:`tessera.diffusion.sampler.sample`, spread over the ranks as
    ``config`` says. Every rank returns the final latent (B, C, H, W)."""
    adapter = DiTAdapter(model)
    check_layout(adapter, config, height, width)
    mesh = mesh or config.build_mesh()
    common = dict(
        height=height,
        width=width,
        num_steps=num_steps,
        guidance_scale=guidance_scale,
        seed=seed,
        progress=progress,
    )
    if config.method == "pipefusion":
        return pipefusion_sample(adapter, labels, mesh=mesh, config=config, **common)
    if config.method == "distrifusion":
        kernel = DistriFusionKernel(mesh, config.warmup_steps)
        return band_sample(adapter, labels, mesh=mesh, band_axes=("distrifusion",), kernel=kernel, **common)
    if config.method == "tp":
        with tensor_parallel(adapter, mesh):
            return band_sample(adapter, labels, mesh=mesh, band_axes=(), kernel=None, **common)
    return band_sample(
        adapter, labels, mesh=mesh, band_axes=("ring", "ulysses"), kernel=USPKernel(mesh), **common
    )
