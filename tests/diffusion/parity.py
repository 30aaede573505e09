"""Helpers shared by the parity tests."""

import torch


def perturbed(module: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    """Random weights moved off a zero-initialised start (adaLN-zero makes every block the
    identity there, and any two methods would agree trivially)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)
    return module.eval()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: random models' latents reach ~1e3 with cancellations, where
    per-element relative checks are ill-conditioned."""
    return ((a - b).norm() / b.norm()).item()


def exact_two_rank_layouts(steps: int) -> dict:
    """Every exact layout on 2 ranks (stale-K/V methods with warm-up = all steps); 8 token
    rows in 3 patches (3 + 3 + 2) so the patches do not divide the height."""
    from tessera.diffusion.layout import ParallelConfig

    return {
        "ulysses2": ParallelConfig(ulysses=2),
        "ring2": ParallelConfig(ring=2),
        "cfg2": ParallelConfig(cfg_parallel=True),
        "pipefusion2": ParallelConfig(pipefusion=2, patches=3, warmup_steps=steps),
        "distrifusion2": ParallelConfig(distrifusion=2, warmup_steps=steps),
    }


def stale_two_rank_layouts() -> dict:
    """The stale-K/V methods on 2 ranks with and without a warm-up step; 3 patches over 8
    token rows (3 + 3 + 2), and models with 3 layers over 2 stages (2 + 1) where they have 3."""
    from tessera.diffusion.layout import ParallelConfig

    return {
        f"{method}2_warmup{warm}": ParallelConfig(
            **{method: 2}, patches=3 if method == "pipefusion" else None, warmup_steps=warm
        )
        for method in ("pipefusion", "distrifusion")
        for warm in (0, 1)
    }


def check_against(expected: torch.Tensor, results: dict[str, torch.Tensor]) -> None:
    for name, latent in results.items():
        error = relative_error(latent, expected)
        # Exact layouts: split attention and batched branches change float32 rounding
        # only (measured ~2e-7); 1e-5 leaves a 50x margin.
        assert error < 1e-5, (name, error)


def check_layouts(
    results: dict[str, torch.Tensor],
    exact: torch.Tensor,
    references: dict[str, torch.Tensor],
    *,
    tolerance: float = 1e-5,
) -> None:
    """Stale-K/V runs (those with a reference) against their reference, the rest against
    exact sampling."""
    check_against(exact, {k: v for k, v in results.items() if k not in references})
    check_stale({k: v for k, v in results.items() if k in references}, references, exact, tolerance=tolerance)


def check_stale(
    results: dict[str, torch.Tensor],
    references: dict[str, torch.Tensor],
    exact: torch.Tensor,
    *,
    tolerance: float = 1e-5,
) -> None:
    """Each stale-K/V run against the plain reference of its own semantics
    (tessera.diffusion.stale_reference). ``tolerance`` bounds ||run - reference|| / ||reference||:
    float32 rounding only (split batches and ring merges reorder sums); the default 1e-5 is
    30x the largest gap measured on the tiny diffusers models (3e-7; most runs are bit-equal).
    The reference must itself be at least 10x the tolerance away from exact sampling, so a
    patch reading a wrong K/V block could not hide inside the tolerance."""
    for name, latent in results.items():
        error, effect = relative_error(latent, references[name]), relative_error(references[name], exact)
        assert error < tolerance, (name, error)
        assert effect > 10 * tolerance, (name, effect)


def joint_inputs(batch: int) -> dict[str, torch.Tensor]:
    """Random conditioning and noise for the tiny SD3 / Flux transformers: a 6-token prompt
    of width 24, pooled width 16, a 4-channel 16 x 12 latent (8 x 6 tokens)."""
    g = torch.Generator().manual_seed(1)
    shapes = {
        "text": (batch, 6, 24),
        "negative": (batch, 6, 24),
        "pooled": (batch, 16),
        "negative_pooled": (batch, 16),
        "noise": (batch, 4, 16, 12),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
