"""Generate with PipeFusion: a tiny class-conditional DiT sampled over 2 ranks.

    python examples/generate_pipefusion.py                 # 2 ranks, 4 patches, 1 warm-up step
    python examples/generate_pipefusion.py --nproc 4 --depth 8 --size 32

PipeFusion (see docs/parallel_inference.md) splits the DiT's layers into one stage per rank
and the image into patches that flow through the stages; after the warm-up steps each patch
attends to the other patches' one-step-stale K/V. So it is not equal to serial sampling: the
script checks the result against `tessera.diffusion.stale_reference` (the same semantics
written plainly, in one process) and reports how far both are from exact serial sampling.
"""

import argparse

import torch

import tessera
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_sample
from tessera.diffusion.sampler import sample
from tessera.diffusion.stale_reference import stale_reference_sample
from tessera.models.dit import DiT, DiTConfig

# float32 rounding only: the stages' sums run in another order than the reference's; the
# tests measure gaps of ~1e-5 relative on random DiTs (tests/diffusion/test_parallel_parity.py)
TOLERANCE = 1e-4


def tiny_dit(args: argparse.Namespace) -> DiT:
    torch.manual_seed(0)  # every rank builds the same weights
    config = DiTConfig(
        image_size=args.size, patch_size=2, hidden_size=args.hidden, depth=args.depth, num_heads=4
    )
    model = DiT(config)
    with torch.no_grad():  # move off adaLN-zero's identity start, so attention matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def sampling(args: argparse.Namespace) -> dict:
    return dict(height=args.size, width=args.size, num_steps=args.steps, guidance_scale=2.0, seed=0)


def rank_main(args: argparse.Namespace, config: ParallelConfig, labels: torch.Tensor) -> torch.Tensor:
    """One rank: build the model, take this rank's stage, sample; every rank returns the latent."""
    return parallel_sample(tiny_dit(args), labels, config=config, **sampling(args))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks = PipeFusion stages")
    parser.add_argument("--patches", type=int, default=4, help="patches along the height")
    parser.add_argument("--warmup-steps", type=int, default=1, help="synchronous steps before stale K/V")
    parser.add_argument("--steps", type=int, default=4, help="sampling steps")
    parser.add_argument("--size", type=int, default=16, help="latent height and width")
    parser.add_argument("--hidden", type=int, default=32, help="hidden size")
    parser.add_argument("--depth", type=int, default=4, help="transformer blocks")
    args = parser.parse_args()

    config = ParallelConfig(pipefusion=args.nproc, patches=args.patches, warmup_steps=args.warmup_steps)
    labels = torch.tensor([3, 7])
    latents = tessera.spawn(rank_main, args.nproc, args, config, labels)  # local gloo ranks
    model = tiny_dit(args)
    reference = stale_reference_sample(model, labels, config=config, **sampling(args))
    serial = sample(model, labels, image_shape=(1, args.size, args.size), num_steps=args.steps,
                    guidance_scale=2.0, seed=0, progress=False)  # fmt: skip
    gap = relative(latents[0], reference)
    print(f"PipeFusion on {args.nproc} ranks, {args.patches} patches, warm-up {args.warmup_steps}: "
          f"latent {tuple(latents[0].shape)}")  # fmt: skip
    print(f"distance from its stale-K/V reference: {gap:.2e} (float32 rounding); from exact serial sampling: "
          f"{relative(latents[0], serial):.3f} (the stale K/V's effect)")  # fmt: skip
    if gap > TOLERANCE:
        raise SystemExit(f"PipeFusion run is {gap:.2e} from its reference, over {TOLERANCE:g}")


if __name__ == "__main__":
    main()
