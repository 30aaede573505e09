"""AutoChunk: an Evoformer block's activation-heavy regions computed in slices, same result.

    python examples/autochunk_evoformer.py                         # 64 residues, 8 sequences
    python examples/autochunk_evoformer.py --residues 256 --max-memory-mib 64

`tessera.autochunk(module, example_inputs)` traces the module with fake tensors, estimates
its activation memory node by node, and rewrites the regions around the peak (here the
pair representation's triangle updates and attention, residues^2 x channels and more) as
loops over slices (FastFold's AutoChunk; see docs/autochunk.md). The script prints the plan
with the estimated peak before and after, and checks that the chunked block computes what
the original does.
"""

import argparse

import torch

import tessera
from tessera.models.evoformer import EvoformerBlock, EvoformerConfig

MiB = 2**20
# slices compute the same sums in other orders: float32 rounding only (the autochunk tests
# hold the Evoformer to the same 1e-5)
TOLERANCE = 1e-5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--residues", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=8, help="MSA rows")
    parser.add_argument("--max-memory-mib", type=float, help="activation budget (default: as low as it pays)")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = EvoformerConfig(c_m=16, c_z=8, msa_heads=2, msa_head_dim=4, pair_heads=2, pair_head_dim=4,
                             c_mul=8, c_opm=4, num_blocks=1)  # fmt: skip
    block = EvoformerBlock(config).eval()
    r, s = args.residues, args.sequences
    inputs = (
        torch.randn(1, s, r, config.c_m),  # MSA representation
        torch.randn(1, r, r, config.c_z),  # pair representation
        torch.ones(1, s, r),  # MSA mask
        torch.ones(1, r, r),  # pair mask
    )
    budget = int(args.max_memory_mib * MiB) if args.max_memory_mib else None

    chunked = tessera.autochunk(block, inputs, max_memory=budget)
    print(chunked.plan.describe())
    with torch.no_grad():
        want, got = block(*inputs), chunked(*inputs)
    error = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))
    print(f"largest difference from the original block: {error:.1e} of its largest output")
    if error > TOLERANCE:
        raise SystemExit(f"the chunked block is {error:.1e} from the original, over {TOLERANCE:g}")


if __name__ == "__main__":
    main()
