"""Dynamic Axial Parallelism on 1, 2 and 4 gloo ranks against the single-device
Evoformer, for lengths that divide the degree and that do not."""

import re

import pytest
import torch

from tessera.fold.dap import DAPLayout, dap_evoformer
from tessera.models.evoformer import Evoformer, EvoformerConfig, GatedSelfAttention
from tessera.runtime import Mesh, spawn

CFG = EvoformerConfig(
    c_m=16, c_z=8, msa_heads=2, msa_head_dim=4, pair_heads=2, pair_head_dim=4, c_mul=8, c_opm=4, num_blocks=2
)
CASES = {"divides": (4, 8), "pads": (3, 6)}  # (sequences, residues): 6 and 3 need padding at 4 ranks


def model() -> Evoformer:
    torch.manual_seed(0)
    evo = Evoformer(CFG)
    with torch.no_grad():
        for p in evo.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return evo.eval()


def inputs(s: int, r: int):
    g = torch.Generator().manual_seed(s * 100 + r)
    m, z = torch.randn(1, s, r, CFG.c_m, generator=g), torch.randn(1, r, r, CFG.c_z, generator=g)
    msa_mask, pair_mask = torch.ones(1, s, r), torch.ones(1, r, r)
    msa_mask[:, :, -1] = 0  # a padded residue in the data itself
    pair_mask[:, -1, :] = pair_mask[:, :, -1] = 0
    return m, z, msa_mask, pair_mask


def _run() -> dict:
    mesh = Mesh(dap=torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
    evo, out = model(), {}
    for name, (s, r) in CASES.items():
        mesh.comm.ledger.reset()
        out[name] = dap_evoformer(evo, *inputs(s, r), mesh=mesh)
        out[name + "_calls"] = {op: mesh.comm.ledger.count(op=op) for op in ("all_gather", "all_to_all")}
    layout = DAPLayout(mesh, "dap")
    z = torch.randn(1, 4 // mesh.size("dap") * mesh.size("dap"), 4, 3)
    z_rows = layout.local(z, 1)
    out["round_trip"] = torch.equal(layout.columns_to_rows(layout.rows_to_columns(z_rows)), z_rows)
    out["columns"] = torch.equal(layout.rows_to_columns(z_rows), layout.local(z, 2))
    return out


def test_dap_matches_the_single_device_evoformer():
    evo = model()
    with torch.no_grad():
        expected = {name: evo(*inputs(s, r)) for name, (s, r) in CASES.items()}
    results = {1: [_run()]} | {p: spawn(_run, p, timeout_s=300) for p in (2, 4)}
    for p, ranks in results.items():
        for out in ranks:
            for name, (_s, _r) in CASES.items():
                (m, z), (ref_m, ref_z) = out[name], expected[name]
                # Real positions only: the last residue is masked in the data, and a fully
                # masked attention row averages over whatever padding there is. Unit-scale
                # inputs; sharded einsums and attention change float32 summation order only
                # (measured <= 3e-7 absolute), so 1e-5 holds DAP to fp32 exactness.
                torch.testing.assert_close(
                    m[:, :, :-1], ref_m[:, :, :-1], rtol=1e-5, atol=1e-5, msg=f"P={p} {name}"
                )
                torch.testing.assert_close(
                    z[:, :-1, :-1], ref_z[:, :-1, :-1], rtol=1e-5, atol=1e-5, msg=f"P={p} {name}"
                )
                calls = out[name + "_calls"]
                if p > 1:  # 6 all-gathers + 6 all-to-alls per block, 2 gathers of the outputs
                    assert calls == {
                        "all_gather": 6 * CFG.num_blocks + 2,
                        "all_to_all": 6 * CFG.num_blocks,
                    }, calls
            assert out["round_trip"] and out["columns"]  # the inverse all-to-all undoes the forward one


def _loss_weights(s: int, r: int):
    """Random weights on the real positions only (see the forward test on masked ones)."""
    g = torch.Generator().manual_seed(7)
    w_m, w_z = torch.randn(1, s, r, CFG.c_m, generator=g), torch.randn(1, r, r, CFG.c_z, generator=g)
    w_m[:, :, -1] = 0
    w_z[:, -1, :] = w_z[:, :, -1] = 0
    return w_m, w_z


def _gradients(world: int) -> dict[str, torch.Tensor]:
    """Gradients of a fixed linear loss of both outputs w.r.t. parameters and inputs."""
    mesh = Mesh(dap=world)
    evo, (s, r) = model(), CASES["pads"]
    m, z, msa_mask, pair_mask = inputs(s, r)
    m.requires_grad_(True)
    z.requires_grad_(True)
    if world == 1:
        out_m, out_z = evo(m, z, msa_mask, pair_mask)
    else:
        out_m, out_z = dap_evoformer(evo, m, z, msa_mask, pair_mask, mesh=mesh)
    w_m, w_z = _loss_weights(s, r)
    # Every rank holds the whole output: each computes 1/world of the loss, so the shares sum to it.
    (((out_m * w_m).sum() + (out_z * w_z).sum()) / world).backward()
    grads = {name: p.grad for name, p in evo.named_parameters()} | {"input_m": m.grad, "input_z": z.grad}
    for g in grads.values():  # each rank's gradients are its share of the total
        mesh.comm.all_reduce(g, "dap")
    return grads


def test_dap_gradients_match_the_single_device_evoformer():
    expected = _gradients(1)
    for p in (2, 4):
        for rank in spawn(_gradients, p, p, timeout_s=300):
            for name, grad in rank.items():
                # Gradients sum over sharded paths and ranks in another order: float32 rounding,
                # measured well under 1e-5 on these unit-scale inputs.
                torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-5, msg=f"P={p} {name}")


def _too_few_residues() -> str:
    m, z, _, _ = inputs(3, 1)
    try:
        dap_evoformer(model(), m, z, mesh=Mesh(dap=2))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_degree_larger_than_the_length_is_named():
    assert (
        spawn(_too_few_residues, 2) == ["DAP degree 2 is larger than the 1 residues; use at most 1 ranks"] * 2
    )


class WindowedAttention(GatedSelfAttention):
    """A user's gated attention that only looks at nearby keys: another computation."""


class RecyclingEvoformer(Evoformer):
    """A user's Evoformer with its own forward (recycling, say)."""


def _with(change):
    evo = model()
    change(evo)
    return evo


DAP_REFUSALS = {
    "model_class": (
        lambda: RecyclingEvoformer(CFG),
        "DAP runs tessera.models.evoformer.Evoformer, not RecyclingEvoformer (whose own forward",
    ),
    "attention_class": (
        lambda: _with(lambda e: setattr(e.blocks[1].msa_row, "attention", WindowedAttention(16, 2, 4))),
        "DAP computes blocks.1.msa_row.attention as GatedSelfAttention does, but it is a WindowedAttention",
    ),
    "transition_class": (
        lambda: _with(lambda e: setattr(e.blocks[0], "pair_transition", torch.nn.Identity())),
        "DAP computes blocks.0.pair_transition as Transition does, but it is a Identity",
    ),
    "flipped_triangle": (
        lambda: _with(lambda e: setattr(e.blocks[0].tri_mul_in, "outgoing", True)),
        "DAP shards blocks.0.tri_mul_in for outgoing=False, but it has outgoing=True",
    ),
}


@pytest.mark.parametrize("case", DAP_REFUSALS, ids=list(DAP_REFUSALS))
def test_modules_dap_would_not_compute_as_the_model_does_are_refused(case):
    """DAP re-implements most Evoformer modules' forwards: another class in their place (a
    subclass too), or a flipped triangle module, is refused by name before any work."""
    build, message = DAP_REFUSALS[case]
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        dap_evoformer(build(), *inputs(3, 6), mesh=Mesh(dap=1))
