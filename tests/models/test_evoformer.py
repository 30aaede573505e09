"""The Evoformer block against the supplement's formulas, masks, bf16 and validation."""

import math

import pytest
import torch

from tessera.models.evoformer import Evoformer, EvoformerConfig, TriangleAttention, TriangleMultiplication

SMALL = EvoformerConfig(
    c_m=16, c_z=8, msa_heads=2, msa_head_dim=4, pair_heads=2, pair_head_dim=4, c_mul=8, c_opm=4, num_blocks=2
)


def _randomised(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return module.eval()


def _inputs(s: int = 3, r: int = 5):
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, s, r, SMALL.c_m, generator=g), torch.randn(2, r, r, SMALL.c_z, generator=g)


def test_alphafold_defaults_run():
    cfg = EvoformerConfig(num_blocks=1)  # c_m 256, c_z 128, 8 and 4 heads: the paper's sizes
    m, z = torch.randn(1, 2, 6, cfg.c_m), torch.randn(1, 6, 6, cfg.c_z)
    out_m, out_z = Evoformer(cfg).eval()(m, z)
    assert out_m.shape == m.shape and out_z.shape == z.shape
    assert torch.isfinite(out_m).all() and torch.isfinite(out_z).all()


@pytest.mark.parametrize("starting", [True, False])
def test_triangle_attention_matches_algorithms_13_and_14(starting):
    """Starting node: z_ij attends over k to z_ik with bias b_jk. Ending node: z_ij attends
    to z_kj with bias b_ki. Written out with loops, straight from the supplement."""
    att = _randomised(TriangleAttention(SMALL, starting=starting))
    _, z = _inputs(r=4)
    z = z[:1]
    out = att(z, torch.ones(1, 4, 4))
    a = att.attention
    h = a.norm(z)[0]
    q, k, v = a.to_qkv(h).chunk(3, dim=-1)
    gate, bias = torch.sigmoid(a.to_gate(h)), att.to_bias(h)  # (r, r, H)
    heads, d = SMALL.pair_heads, SMALL.pair_head_dim
    expected = torch.zeros(4, 4, heads * d)
    for i in range(4):
        for j in range(4):
            for hd in range(heads):
                sl = slice(hd * d, (hd + 1) * d)
                if starting:
                    keys = [(i, kk) for kk in range(4)]
                    biases = [bias[j, kk, hd] for kk in range(4)]
                else:
                    keys = [(kk, j) for kk in range(4)]
                    biases = [bias[kk, i, hd] for kk in range(4)]
                logits = torch.stack(
                    [q[i, j, sl] @ k[key][sl] / math.sqrt(d) + b for key, b in zip(keys, biases, strict=True)]
                )
                weights = torch.softmax(logits, dim=0)
                expected[i, j, sl] = gate[i, j, sl] * sum(
                    w * v[key][sl] for w, key in zip(weights, keys, strict=True)
                )
    torch.testing.assert_close(out[0], a.to_out(expected), rtol=1e-5, atol=1e-5)  # float32 summation order


def test_incoming_is_outgoing_on_the_transposed_pair():
    """Algorithm 12 from algorithm 11: sum_k a_ki b_kj is the transpose of the outgoing
    update of z^T with the left and right projections exchanged."""
    _, z = _inputs()
    mask = torch.ones(z.shape[:3])
    mask[:, 4, :] = 0
    incoming = _randomised(TriangleMultiplication(SMALL, outgoing=False))
    outgoing = TriangleMultiplication(SMALL, outgoing=True).eval()
    swap = {"left": "right", "right": "left", "left_gate": "right_gate", "right_gate": "left_gate"}
    state = {}
    for key, value in incoming.state_dict().items():
        module, _, param = key.partition(".")
        state[f"{swap.get(module, module)}.{param}"] = value
    outgoing.load_state_dict(state)
    expected = outgoing(z.transpose(1, 2), mask.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(incoming(z, mask), expected, rtol=1e-5, atol=1e-5)  # einsum order only


def test_padding_does_not_reach_real_positions():
    model = _randomised(Evoformer(SMALL))
    m, z = _inputs(s=4, r=6)
    msa_mask, pair_mask = torch.ones(m.shape[:3]), torch.ones(z.shape[:3])
    msa_mask[:, 3] = 0  # a padded sequence
    msa_mask[:, :, 5] = 0  # a padded residue
    pair_mask[:, 5, :] = pair_mask[:, :, 5] = 0
    out_m, out_z = model(m, z, msa_mask, pair_mask)
    m2, z2 = m.clone(), z.clone()
    m2[:, 3] += 5.0
    m2[:, :, 5] += 5.0
    z2[:, 5, :] += 5.0
    z2[:, :, 5] += 5.0
    out_m2, out_z2 = model(m2, z2, msa_mask, pair_mask)
    # Real entries only: padded ones may change; float32 rounding of the masked softmax.
    torch.testing.assert_close(out_m2[:, :3, :5], out_m[:, :3, :5], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out_z2[:, :5, :5], out_z[:, :5, :5], rtol=1e-4, atol=1e-4)


def test_bf16_follows_fp32():
    model = _randomised(Evoformer(SMALL))
    m, z = _inputs()
    ref_m, ref_z = model(m, z)
    out_m, out_z = model.to(torch.bfloat16)(m.bfloat16(), z.bfloat16())
    for out, ref in ((out_m, ref_m), (out_z, ref_z)):
        # bf16 keeps 8 mantissa bits (~4e-3 relative) over two blocks of sums: 3e-2 relative.
        assert ((out.float() - ref).norm() / ref.norm()).item() < 3e-2


def test_bad_config_and_shapes_are_named():
    with pytest.raises(ValueError, match="EvoformerConfig.c_z must be a positive integer, got 0"):
        EvoformerConfig(c_z=0)
    model = Evoformer(SMALL)
    m, z = _inputs(r=5)
    with pytest.raises(ValueError, match=r"pair must be \(B=2, r=5, r=5, c_z=8\).*got \(2, 4, 4, 8\)"):
        model(m, z[:, :4, :4])
    with pytest.raises(ValueError, match=r"MSA must be \(B, s, r, c_m=16\), got \(2, 3, 5, 15\)"):
        model(m[..., :15], z)
