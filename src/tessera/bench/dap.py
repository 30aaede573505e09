"""`tessera bench dap`: Dynamic Axial Parallelism for the Evoformer on P = 1, 2, 4 ranks
(one thread each): communication bytes per block against the formula, and the peak
memory each rank adds during the forward pass, measured in a fresh process per P.

Bytes follow `tessera.runtime.comm`'s convention (what each rank hands to the collective,
summed over ranks). With s', r' the sequence and residue counts padded to multiples of P
and e bytes per element, one block moves

    e * [ s'r' (2 c_m + c_opm) + r'^2 (H_msa + 2 c_mul + 4 c_z + 2 H_pair) ]

(two all-to-alls of the MSA, the outer product mean's gathered projection; the row
attention's pair bias, two triangle-multiplication projections, four all-to-alls of the
pair and two triangle-attention biases), plus the final gather of both outputs
e * (s'r' c_m + r'^2 c_z).
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from tessera.bench.harness import BenchResult
from tessera.fold.dap import dap_evoformer
from tessera.memory.track import peak_resident_bytes, resident_bytes
from tessera.models.evoformer import Evoformer, EvoformerConfig
from tessera.runtime import Mesh, spawn

FULL_CONFIG = EvoformerConfig(num_blocks=2)  # AlphaFold2's channel sizes
QUICK_CONFIG = EvoformerConfig(c_m=64, c_z=32, c_mul=32, c_opm=16, num_blocks=1)


def formula_bytes(cfg: EvoformerConfig, s: int, r: int, p: int, element_bytes: int = 4) -> dict[str, int]:
    if p == 1:
        return {"per_block": 0, "total": 0}
    s, r = s + (-s % p), r + (-r % p)
    per_block = element_bytes * (
        s * r * (2 * cfg.c_m + cfg.c_opm)
        + r * r * (cfg.msa_heads + 2 * cfg.c_mul + 4 * cfg.c_z + 2 * cfg.pair_heads)
    )
    final = element_bytes * (s * r * cfg.c_m + r * r * cfg.c_z)
    return {"per_block": per_block, "total": per_block * cfg.num_blocks + final}


def _rank_run(cfg: EvoformerConfig, s: int, r: int) -> dict:
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = Evoformer(cfg).eval()
    g = torch.Generator().manual_seed(1)
    m, z = torch.randn(1, s, r, cfg.c_m, generator=g), torch.randn(1, r, r, cfg.c_z, generator=g)
    mesh = Mesh(dap=world)
    rss_before = resident_bytes()
    began = time.perf_counter()
    with torch.no_grad():
        if world == 1:
            model(m, z)
        else:
            dap_evoformer(model, m, z, mesh=mesh)
    return {
        "seconds": time.perf_counter() - began,
        "extra_bytes": max(0, peak_resident_bytes() - rss_before),
        "bytes": mesh.comm.ledger.total() - mesh.comm.ledger.total(op="recv"),
    }


def run_dap_bench(*, quick: bool, progress: bool = True) -> BenchResult:
    cfg = QUICK_CONFIG if quick else FULL_CONFIG
    s, r = (16, 48) if quick else (64, 160)
    rows = []
    for p in tqdm((1, 2, 4), desc="bench dap", disable=not progress):
        ranks = spawn(_rank_run, p, cfg, s, r, timeout_s=1800)
        measured, formula = sum(x["bytes"] for x in ranks), formula_bytes(cfg, s, r, p)
        rows.append(
            {
                "ranks": p,
                "sequences": s,
                "residues": r,
                "seconds": round(max(x["seconds"] for x in ranks), 3),
                "bytes_per_block": (measured - (formula["total"] - formula["per_block"] * cfg.num_blocks))
                // cfg.num_blocks
                if p > 1
                else 0,
                "formula_bytes_per_block": formula["per_block"],
                "bytes_total": measured,
                "formula_bytes_total": formula["total"],
                "bytes_rel_error": abs(measured - formula["total"]) / formula["total"]
                if formula["total"]
                else float(measured != 0),
                "peak_extra_mib_per_rank": round(max(x["extra_bytes"] for x in ranks) / 2**20, 1),
            }
        )
    base = rows[0]["peak_extra_mib_per_rank"]
    headline = {
        "max_bytes_rel_error": max(row["bytes_rel_error"] for row in rows),
        "memory_per_rank_ratio_p4": round(rows[-1]["peak_extra_mib_per_rank"] / base, 3) if base else None,
    }
    notes = [
        f"Evoformer {cfg.num_blocks} block(s), c_m={cfg.c_m}, c_z={cfg.c_z}; {s} sequences x {r} residues; "
        "1 thread per rank; forward pass (inference)",
        "memory: the rise of the process's peak resident set during the forward pass, each P in fresh processes",
        "bytes: summed over ranks, receives not added; the formula is in src/tessera/bench/dap.py",
    ]
    columns = [
        "ranks",
        "seconds",
        "bytes_per_block",
        "formula_bytes_per_block",
        "bytes_total",
        "formula_bytes_total",
        "bytes_rel_error",
        "peak_extra_mib_per_rank",
    ]
    return BenchResult(
        name="dap",
        headline=headline,
        rows=rows,
        columns=columns,
        notes=notes,
        extra={"config": cfg.__dict__, "sequences": s, "residues": r},
    )


def plot_dap(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_bytes) = plt.subplots(1, 2, figsize=(10, 4))
    ranks = [row["ranks"] for row in result.rows]
    ax_mem.bar([str(p) for p in ranks], [row["peak_extra_mib_per_rank"] for row in result.rows])
    ax_mem.set(xlabel="DAP ranks", ylabel="MiB", title="Peak memory added per rank (forward)")
    xs = range(len(ranks))
    ax_bytes.bar(
        [x - 0.2 for x in xs],
        [row["bytes_total"] / 2**20 for row in result.rows],
        width=0.4,
        label="measured",
    )
    ax_bytes.bar(
        [x + 0.2 for x in xs],
        [row["formula_bytes_total"] / 2**20 for row in result.rows],
        width=0.4,
        label="formula",
    )
    ax_bytes.set_xticks(list(xs), [str(p) for p in ranks])
    ax_bytes.set(xlabel="DAP ranks", ylabel="MiB, all ranks", title="Communication per forward pass")
    ax_bytes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
