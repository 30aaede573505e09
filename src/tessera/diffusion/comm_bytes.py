"""Analytic communication volume of each parallel DiT inference method.

Counted exactly as `tessera.runtime.comm` counts (bytes this rank hands to the network
layer; receives mirror sends and are not added), summed over all ranks and over a whole
sampling run of S steps. Notation: L layers, n tokens, h hidden size, e bytes per element,
Bm the model batch on a rank (2B when both guidance branches run on it), and
lat = B*C*H*W*e the latent of the B requested images.

    pipefusion P   (P-1)*S*Bm*n*h*e   hidden patches down the pipeline
                   + (S-1)*lat         new latent patches back to stage 0 (not after the last step)
                   + P*lat             final broadcast of the latent to every stage
    ulysses U      S*L*4*Bm*n*h*e      all-to-all of q, k, v and the output, per layer
                   + lat               final all-gather of the bands
    ring R         S*L*2*(R-1)*Bm*n*h*e    each K/V block sent R-1 times
                   + lat
    distrifusion D S*L*2*Bm*n*h*e      all-gather of every band's K and V, per layer
                   + lat
    tp T           S*L*2*T*Bm*n*h*e    all-reduce after attention and after the MLP
    cfg (2 ranks)  S*2*lat             all-gather of each branch's velocity
                   (and each branch runs its method on its own ranks: the method's bytes x 2)
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.diffusion.layout import ParallelConfig


@dataclass(frozen=True, kw_only=True)
class Dims:
    steps: int
    layers: int
    tokens: int
    hidden: int
    batch: int  # requested images B
    latent_elems: int  # C*H*W of one image
    guidance: bool
    element_bytes: int = 4
    # tensor parallel: the tokens x hidden all-reduces of a layer (Tessera's DiT: attention and
    # MLP outputs, 2; diffusers' Wan/LTX/PixArt: self- and cross-attention and MLP, 3) and the
    # per-token scalars a layer all-reduces for query/key norms across heads (Wan, LTX: each
    # token's sum of squares for self q and k and cross q, plus cross k over the text tokens)
    tp_all_reduces: int = 2
    tp_norm_rows: int = 0


def formula_bytes(config: ParallelConfig, d: Dims) -> int:
    lat = d.batch * d.latent_elems * d.element_bytes
    split = config.cfg_parallel
    model_batch = d.batch * (2 if d.guidance and not split else 1)
    act = model_batch * d.tokens * d.hidden * d.element_bytes  # one activation of the sequence
    method, group = config.method, 0  # group: the bytes of one cfg branch's ranks
    if method == "pipefusion":
        p = config.pipefusion
        if p > 1:
            group = (p - 1) * d.steps * act + (d.steps - 1) * lat + p * lat
    elif method == "distrifusion":
        group = d.steps * d.layers * 2 * act + lat
    elif method == "tp":
        norms = model_batch * d.tp_norm_rows * d.element_bytes
        group = d.steps * d.layers * config.tp * (d.tp_all_reduces * act + norms)
    elif method == "sequence":
        u, r = config.ulysses, config.ring
        # inside a Ulysses group the ring moves the group's 1/u of the heads for u x the tokens
        group = d.steps * d.layers * (4 * act * (u > 1) + 2 * (r - 1) * act) + lat
    # Each cfg branch runs the method on its own ranks; the branches swap velocities.
    return group * config.degree("cfg") + (d.steps * 2 * lat if split else 0)


def measured_bytes(ledgers: list[dict[str, dict[str, int]]]) -> int:
    """Sum over ranks of every counted operation but receives."""
    return sum(
        entry["bytes"] for ledger in ledgers for key, entry in ledger.items() if not key.startswith("recv@")
    )
