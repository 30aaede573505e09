"""Dynamic Axial Parallelism (FastFold, Cheng et al. 2022) for the Evoformer: forward pass.

Each rank of the mesh axis holds a 1/P slice of the MSA (along sequences, or along
residues) and of the pair representation (along rows i, or along columns j). An
operation that works along an axis needs that axis whole, so the layout changes with an
all-to-all where the operation requires it, and the small tensors an operation needs in
full (the pair bias of the attentions, one projection of the outer product mean and of
each triangle multiplication) are all-gathered. Per block, in order:

    MSA row attention      m by sequence   all-gather the pair bias (r x r x H)
    MSA column attention   m by residue    all-to-all m (sequence -> residue)
    MSA transition         m by residue
    outer product mean     z by row        all-gather the right projection (s x r x c)
                                           all-to-all m (residue -> sequence), for the next block
    triangle mult. out     z by row        all-gather the right projection (r x r x c)
    triangle mult. in      z by column     all-to-all z (row -> column); all-gather the left projection
    triangle att. start    z by row        all-to-all z (column -> row); all-gather the bias
    triangle att. end      z by column     all-to-all z (row -> column); all-gather the bias
    pair transition        z by column     all-to-all z (column -> row)

that is 6 all-gathers and 6 all-to-alls per block. Each all-gather is launched
asynchronously and waited for only when its result is needed, with the independent work
(the queries/keys/values, the other projection, the gates) computed in between. Lengths that do not divide P are
padded with masked positions, which the Evoformer's masks keep away from real ones.
The attentions' key masks and pair biases, the outer product mean's masked count and the
triangle multiplications' masks are computed as the model computes them. DAP re-implements
the forward of most Evoformer modules, and runs the rest on one shard of an axis, so a model
whose modules are of other classes (a subclass too: it may compute something else) or whose
triangle modules are flipped is refused by name before any work (``check_dap_model``).
The collectives are differentiable (all-gather backward is a reduce-scatter, all-to-all
backward the inverse all-to-all), so the same code trains.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tessera.models.evoformer import (
    Evoformer,
    EvoformerBlock,
    GatedSelfAttention,
    MSAColumnAttention,
    MSARowAttentionWithPairBias,
    OuterProductMean,
    Transition,
    TriangleAttention,
    TriangleMultiplication,
    _gated_attention,
    _heads,
    _key_mask_bias,
)
from tessera.runtime.mesh import Mesh


class DAPLayout:
    """The re-sharding collectives along one mesh axis."""

    def __init__(self, mesh: Mesh, axis: str):
        self.comm, self.axis = mesh.comm, axis
        self.size, self.rank = mesh.size(axis), mesh.rank(axis)

    def rows_to_columns(self, z: torch.Tensor) -> torch.Tensor:
        """(B, r/P, r, c) -> (B, r, r/P, c); the MSA's (B, s/P, r, c) -> (B, s, r/P, c) alike."""
        return self.comm.all_to_all(z.contiguous(), self.axis, scatter_dim=2, gather_dim=1)

    def columns_to_rows(self, z: torch.Tensor) -> torch.Tensor:
        return self.comm.all_to_all(z.contiguous(), self.axis, scatter_dim=1, gather_dim=2)

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self.comm.all_gather(t.contiguous(), self.axis, dim=dim)

    def launch_gather(self, t: torch.Tensor, dim: int) -> Callable[[], torch.Tensor]:
        """Start an all-gather and return its wait: the caller computes in between (FastFold's
        duality async operations). Under autograd the differentiable gather runs at once."""
        if torch.is_grad_enabled() and t.requires_grad:
            gathered = self.gather(t, dim)
            return lambda: gathered
        return self.comm.all_gather_async(t.contiguous(), self.axis, dim=dim)

    def local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(self.size, dim=dim)[self.rank]


def _attend(attention, x, mask, norm, to_bias, z_rows, layout: DAPLayout):
    """Gated attention along x's second-to-last axis, biased by the full (r x r x H) pair
    bias, whose all-gather runs while the queries, keys and values are computed."""
    bias_wait = layout.launch_gather(to_bias(norm(z_rows)), dim=1)
    h = attention.norm(x)
    q, k, v = (_heads(t, attention.heads) for t in attention.to_qkv(h).chunk(3, dim=-1))
    gate, key_bias = attention.to_gate(h), _key_mask_bias(mask)
    bias = bias_wait().permute(0, 3, 1, 2)[:, None]  # (B, 1, H, r, r)
    return _gated_attention(q, k, v, key_bias + bias, gate, attention.to_out)


def _outer_product_mean(opm, m_cols, mask_cols, mask_full, layout: DAPLayout) -> torch.Tensor:
    """Rows i of the update from the MSA sharded by residue (algorithm 10). The masks are
    inputs every rank holds whole, so only the projection is gathered."""
    h = opm.norm(m_cols)
    mask = mask_cols.to(h.dtype)
    b_wait = layout.launch_gather(opm.right(h) * mask[..., None], dim=2)
    a = opm.left(h) * mask[..., None]  # computed while b travels
    outer = torch.einsum("bsic,bsjd->bijcd", a, b_wait()).flatten(-2)
    count = torch.einsum("bsi,bsj->bij", mask, mask_full.to(h.dtype))[..., None]
    return opm.to_out(outer) / (count + opm.eps)


def _triangle_multiplication(tri, z, mask, layout: DAPLayout) -> torch.Tensor:
    """Outgoing on row-sharded z (gathers b), incoming on column-sharded z (gathers a)."""
    h = tri.norm_in(z)
    mask = mask[..., None].to(h.dtype)
    if tri.outgoing:
        wait = layout.launch_gather(torch.sigmoid(tri.right_gate(h)) * tri.right(h) * mask, dim=1)
        a = torch.sigmoid(tri.left_gate(h)) * tri.left(h) * mask  # computed while b travels
        gate = torch.sigmoid(tri.out_gate(h))
        x = torch.einsum("bikc,bjkc->bijc", a, wait())
    else:
        wait = layout.launch_gather(torch.sigmoid(tri.left_gate(h)) * tri.left(h) * mask, dim=2)
        b = torch.sigmoid(tri.right_gate(h)) * tri.right(h) * mask  # computed while a travels
        gate = torch.sigmoid(tri.out_gate(h))
        x = torch.einsum("bkic,bkjc->bijc", wait(), b)
    return gate * tri.to_out(tri.norm_out(x))


def dap_block(block: EvoformerBlock, m_seq, z_rows, masks: dict, layout: DAPLayout):
    """One Evoformer block on sharded inputs: m by sequence, z by row, and back."""
    row = block.msa_row
    m_seq = m_seq + _attend(
        row.attention, m_seq, masks["msa_seq"], row.pair_norm, row.pair_bias, z_rows, layout
    )
    m_cols = layout.rows_to_columns(m_seq)
    m_cols = m_cols + block.msa_column(m_cols, masks["msa_cols"])
    m_cols = m_cols + block.msa_transition(m_cols)
    opm = block.outer_product_mean
    z_rows = z_rows + _outer_product_mean(opm, m_cols, masks["msa_cols"], masks["msa"], layout)
    m_seq = layout.columns_to_rows(m_cols)
    z_rows = z_rows + _triangle_multiplication(block.tri_mul_out, z_rows, masks["pair_rows"], layout)
    z_cols = layout.rows_to_columns(z_rows)
    z_cols = z_cols + _triangle_multiplication(block.tri_mul_in, z_cols, masks["pair_cols"], layout)
    z_rows = layout.columns_to_rows(z_cols)
    start = block.tri_att_start
    z_rows = z_rows + _attend(
        start.attention, z_rows, masks["pair_rows"], start.attention.norm, start.to_bias, z_rows, layout
    )
    z_cols = layout.rows_to_columns(z_rows)
    end, zt = block.tri_att_end, z_cols.transpose(1, 2)  # rows of z^T: algorithm 14 as 13 on z^T
    mask_t = masks["pair_cols"].transpose(1, 2)
    z_cols = z_cols + _attend(
        end.attention, zt, mask_t, end.attention.norm, end.to_bias, zt, layout
    ).transpose(1, 2)
    z_cols = z_cols + block.pair_transition(z_cols)
    return m_seq, layout.columns_to_rows(z_cols)


# Each block part, the class DAP assumes it is (its forward re-implemented, or run on one
# shard), and the direction flag it must have (None: none).
_BLOCK_PARTS = {
    "msa_row": (MSARowAttentionWithPairBias, None),
    "msa_row.attention": (GatedSelfAttention, None),
    "msa_column": (MSAColumnAttention, None),
    "msa_column.attention": (GatedSelfAttention, None),
    "msa_transition": (Transition, None),
    "outer_product_mean": (OuterProductMean, None),
    "tri_mul_out": (TriangleMultiplication, ("outgoing", True)),
    "tri_mul_in": (TriangleMultiplication, ("outgoing", False)),
    "tri_att_start": (TriangleAttention, ("starting", True)),
    "tri_att_start.attention": (GatedSelfAttention, None),
    "tri_att_end": (TriangleAttention, ("starting", False)),
    "tri_att_end.attention": (GatedSelfAttention, None),
    "pair_transition": (Transition, None),
}


def check_dap_model(model: Evoformer) -> None:
    """A ValueError naming the first module DAP would not compute as the model does."""
    if type(model) is not Evoformer:
        raise ValueError(
            f"DAP runs tessera.models.evoformer.Evoformer, not {type(model).__name__} (whose own forward "
            "it would skip); run this model without DAP"
        )
    for index, block in enumerate(model.blocks):
        where = f"blocks.{index}"
        if type(block) is not EvoformerBlock:
            raise ValueError(
                f"DAP runs EvoformerBlock's forward, but {where} is a {type(block).__name__}; "
                "run this model without DAP"
            )
        for path, (cls, flag) in _BLOCK_PARTS.items():
            part = block.get_submodule(path)
            if type(part) is not cls:
                raise ValueError(
                    f"DAP computes {where}.{path} as {cls.__name__} does, but it is a {type(part).__name__}; "
                    "run this model without DAP"
                )
            if flag is not None and getattr(part, flag[0]) != flag[1]:
                raise ValueError(
                    f"DAP shards {where}.{path} for {flag[0]}={flag[1]}, but it has {flag[0]}={not flag[1]}; "
                    "run this model without DAP"
                )


def _pad(t: torch.Tensor, dims: tuple[int, ...], multiple: int) -> torch.Tensor:
    pads = [0, 0] * t.dim()
    for dim in dims:
        pads[2 * (t.dim() - 1 - dim) + 1] = -t.shape[dim] % multiple
    return F.pad(t, pads)


def dap_evoformer(model: Evoformer, m, z, msa_mask=None, pair_mask=None, *, mesh: Mesh, axis: str = "dap"):
    """The Evoformer's output for full inputs held on every rank, computed with DAP over
    ``axis``; every rank returns the full (m, z). Differentiable: the collectives carry
    gradients back (each rank's parameter gradients are its share; sum them over ``axis``)."""
    msa_mask = torch.ones(m.shape[:3], device=m.device) if msa_mask is None else msa_mask
    pair_mask = torch.ones(z.shape[:3], device=z.device) if pair_mask is None else pair_mask
    check_dap_model(model)
    model.check_inputs(m, z, msa_mask, pair_mask)
    layout = DAPLayout(mesh, axis)
    p, (s, r) = layout.size, m.shape[1:3]
    if p > r:
        raise ValueError(f"DAP degree {p} is larger than the {r} residues; use at most {r} ranks")
    m, msa_mask = _pad(m, (1, 2), p), _pad(msa_mask, (1, 2), p)
    z, pair_mask = _pad(z, (1, 2), p), _pad(pair_mask, (1, 2), p)
    masks = {
        "msa": msa_mask,
        "msa_seq": layout.local(msa_mask, 1),
        "msa_cols": layout.local(msa_mask, 2),
        "pair_rows": layout.local(pair_mask, 1),
        "pair_cols": layout.local(pair_mask, 2),
    }
    m_seq, z_rows = layout.local(m, 1), layout.local(z, 1)
    for block in model.blocks:
        m_seq, z_rows = dap_block(block, m_seq, z_rows, masks, layout)
    return layout.gather(m_seq, dim=1)[:, :s, :r], layout.gather(z_rows, dim=1)[:, :r, :r]
