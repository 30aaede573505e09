"""Serial sampling: flow-matching Euler with classifier-free guidance.

The model is trained on the straight path x_t = (1 - t) x_0 + t * noise (rectified flow,
Liu et al. 2022), predicting the velocity v = noise - x_0; sampling integrates dx/dt = v
from t = 1 (noise) to t = 0 with Euler steps. Every step is elementwise in x, which is
what lets PipeFusion apply it to one patch of the image at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm

VelocityFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class FlowMatchEuler:
    """Uniform time grid from 1 to 0 and the Euler update."""

    def timesteps(self, num_steps: int) -> torch.Tensor:
        if num_steps < 1:
            raise ValueError(f"number of sampling steps must be >= 1, got {num_steps}")
        return torch.linspace(1.0, 0.0, num_steps + 1)

    def step(self, x: torch.Tensor, velocity: torch.Tensor, t: float, t_next: float) -> torch.Tensor:
        return x + (t_next - t) * velocity


def guided_velocity(
    model: VelocityFn,
    x: torch.Tensor,
    t: torch.Tensor,
    labels: torch.Tensor,
    null_label: int,
    guidance_scale: float,
) -> torch.Tensor:
    """v_uncond + s * (v_cond - v_uncond), both branches in one batch (s == 1: no guidance)."""
    if guidance_scale == 1.0:
        return model(x, t, labels)
    both = model(
        torch.cat([x, x]), torch.cat([t, t]), torch.cat([labels, torch.full_like(labels, null_label)])
    )
    cond, uncond = both.chunk(2)
    return uncond + guidance_scale * (cond - uncond)


def initial_noise(
    shape: tuple[int, ...], seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The starting noise for ``seed``: drawn on the CPU so every device and every
    parallel layout starts from the same numbers."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    labels: torch.Tensor,
    *,
    image_shape: tuple[int, int, int],
    num_steps: int,
    guidance_scale: float = 1.0,
    seed: int = 0,
    progress: bool = True,
) -> torch.Tensor:
    """Images (B, C, H, W) for class ``labels`` (B,), from the noise of ``seed``."""
    scheduler = FlowMatchEuler()
    param = next(model.parameters())
    labels = labels.to(param.device)
    x = initial_noise((labels.shape[0], *image_shape), seed, param.device, param.dtype)
    device = param.device
    times = scheduler.timesteps(num_steps).tolist()
    for t, t_next in tqdm(
        list(zip(times[:-1], times[1:], strict=True)), desc="sampling", disable=not progress, leave=False
    ):
        t_batch = torch.full((labels.shape[0],), t, device=device)
        v = guided_velocity(model, x, t_batch, labels, model.null_class, guidance_scale)
        x = scheduler.step(x, v, t, t_next)
    return x
