"""The small Evoformer block and its masked inputs, shared by the autochunk tests."""

import torch

from tessera.models.evoformer import EvoformerBlock, EvoformerConfig

SMALL = EvoformerConfig(
    c_m=16, c_z=8, msa_heads=2, msa_head_dim=4, pair_heads=2, pair_head_dim=4, c_mul=8, c_opm=4, num_blocks=1
)


def evoformer(r=32, s=4):
    """A seeded block in eval mode and (msa, pair, msa_mask, pair_mask) with padded positions,
    so every chunked loop has to slice the masks with the rest."""
    torch.manual_seed(0)
    block = EvoformerBlock(SMALL).eval()
    g = torch.Generator().manual_seed(1)
    msa_mask = torch.ones(1, s, r)
    msa_mask[:, -1, r // 2 :] = 0
    pair_mask = torch.ones(1, r, r)
    pair_mask[:, :, -3:] = 0
    inputs = (torch.randn(1, s, r, SMALL.c_m, generator=g), torch.randn(1, r, r, SMALL.c_z, generator=g))
    return block, inputs + (msa_mask, pair_mask)
