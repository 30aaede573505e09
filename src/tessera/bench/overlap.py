"""`tessera bench overlap`: how much of ZeRO's communication the engine hides behind compute
(``Plan.prefetch``, ``tessera.parallel.zero_overlap``), with and without overlap, in the
same run.

A GPT-2 trains on 2 ranks (gloo, 1 thread each) at ZeRO-2 and ZeRO-3 (block chunks, as FSDP2
shards per block), with ``prefetch=0`` (every collective waits where it is issued) and
``prefetch`` 1 (and 2 in the full run). On one machine loopback makes bytes nearly free, so
every transfer is made to take the time it would on an emulated link (``runtime.link``,
pcie4 unless told): scaled, as ``tessera bench dit`` scales it, by this core's measured fp32
matmul rate over a GPU's (``device``, default the L40), so compute and link keep the balance
that GPU would see.

Per step, of the flat all-gathers and reduce-scatters (``Comm.ledger.hidden``): the link time
issued (each call's emulated transfer time), the part of it training still waited for
(exposed: the link time not yet over when the engine needed the result) and the fraction
hidden, 1 - exposed / issued. The synchronous engine hides nothing (it waits for every
transfer where it issues it); what the overlapped one hides is bounded by the compute there
is to hide behind. ZeRO-2's all-gather of the updated shards after the optimizer step has
no compute beside it and stays exposed in both. Also reported: seconds per step, and the
seconds spent blocked in those calls at all (the real transfer, and a peer slowed by other
jobs on shared cores, on top of the exposed link time).
``--quick``: a smaller model, 2 timed steps, under a minute.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from tessera.bench.harness import BenchResult, matmul_peak_flops
from tessera.plan.devices import device_named
from tessera.runtime import spawn
from tessera.runtime.link import Link, link_named
from tessera.train.gpt2_text import gpt2_lm
from tessera.train.losses import causal_lm_loss

RANKS = 2


@dataclass(frozen=True)
class OverlapBenchConfig:
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 4
    vocab: int = 1024
    seq: int = 128
    global_batch: int = 32
    warmup: int = 2
    steps: int = 5
    prefetch: tuple[int, ...] = (0, 1, 2)
    link: str = "pcie4"
    device: str = "l40"  # whose compute-to-link balance the emulated link keeps


FULL = OverlapBenchConfig()
QUICK = OverlapBenchConfig(
    n_embd=128, n_layer=4, n_head=4, vocab=512, seq=128, global_batch=16, warmup=1, steps=2, prefetch=(0, 1)
)
STAGES = {"zero2": dict(zero=2, block_chunks=True), "zero3": dict(zero=3, block_chunks=True)}


def scaled_link(cfg: OverlapBenchConfig) -> tuple[Link, dict]:
    """``cfg.link`` scaled to this core's compute against ``cfg.device``'s."""
    device = device_named(cfg.device)
    core = matmul_peak_flops(threads=1)
    link = link_named(cfg.link).scaled(core / device.fp32_flops)
    info = {"core_fp32_flops": core, "device": device.name, "device_fp32_flops": device.fp32_flops}
    return link, {**info, "scale": link.scale, "link": link.describe()}


def _rank_run(cfg: OverlapBenchConfig, link: Link) -> list[dict]:
    import tessera

    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, cfg.vocab, (cfg.global_batch, cfg.seq), generator=g)
        for _ in range(cfg.warmup + cfg.steps)
    ]
    out = []
    for stage, settings in STAGES.items():
        for prefetch in cfg.prefetch:
            model = gpt2_lm(
                vocab=cfg.vocab, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head, seq=cfg.seq
            )
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            plan = tessera.Plan(dp=RANKS, prefetch=prefetch, **settings)
            model, opt = tessera.boost(model, optimizer, plan)
            comm = opt.mesh.comm
            for batch in batches[: cfg.warmup]:  # the use order is learned here
                opt.train_step(batch, causal_lm_loss)
            comm.emulate(link)
            steps = []
            for batch in batches[cfg.warmup :]:
                comm.barrier()
                comm.ledger.reset()
                began = time.perf_counter()
                loss = opt.train_step(batch, causal_lm_loss)["loss"]
                seconds = time.perf_counter() - began
                per_op = {
                    op: comm.ledger.hidden((op,))["hidden_fraction"]
                    for op in ("all_gather", "reduce_scatter")
                }
                steps.append({"seconds": seconds, "loss": loss, **comm.ledger.hidden(), "per_op": per_op})
            comm.emulate(None)
            out.append(
                {"stage": stage, "prefetch": prefetch, "steps": steps, "chunks": len(opt.engine.groups)}
            )
    return out


def _row(runs: list[dict]) -> dict:
    """One (stage, prefetch) over both ranks: per step, the slower rank's seconds and the
    ranks' means of the rest."""
    steps = []
    for per_rank in zip(*(r["steps"] for r in runs), strict=True):
        per_op = {
            op: statistics.mean(s["per_op"][op] for s in per_rank if s["per_op"][op] is not None)
            if any(s["per_op"][op] is not None for s in per_rank)
            else None
            for op in ("all_gather", "reduce_scatter")
        }
        mean = {k: statistics.mean(s[k] for s in per_rank) for k in ("link_s", "exposed_s", "blocked_s")}
        hidden = statistics.mean(s["hidden_fraction"] for s in per_rank)
        steps.append(
            {
                "seconds": max(s["seconds"] for s in per_rank),
                "loss": per_rank[0]["loss"],
                **mean,
                "hidden_fraction": hidden,
                "per_op": per_op,
            }
        )
    hidden = [s["hidden_fraction"] for s in steps]
    return {
        "stage": runs[0]["stage"],
        "prefetch": runs[0]["prefetch"],
        "chunks": runs[0]["chunks"],
        "step_s": round(statistics.median(s["seconds"] for s in steps), 4),
        "link_s_per_step": round(statistics.median(s["link_s"] for s in steps), 4),
        "exposed_s_per_step": round(statistics.median(s["exposed_s"] for s in steps), 4),
        "blocked_s_per_step": round(statistics.median(s["blocked_s"] for s in steps), 4),
        "hidden_fraction": round(statistics.median(hidden), 3),
        "hidden_min": round(min(hidden), 3),
        "hidden_max": round(max(hidden), 3),
        **{
            f"hidden_{op}": round(statistics.median(s["per_op"][op] for s in steps), 3)
            if all(s["per_op"][op] is not None for s in steps)
            else None
            for op in ("all_gather", "reduce_scatter")
        },
        "losses": [s["loss"] for s in steps],
    }


def run_overlap_bench(
    *, quick: bool, progress: bool = True, cfg: OverlapBenchConfig | None = None
) -> BenchResult:
    cfg = cfg or (QUICK if quick else FULL)
    link, link_info = scaled_link(cfg)
    ranks = spawn(_rank_run, RANKS, cfg, link, timeout_s=1800)
    rows = [_row([r[i] for r in ranks]) for i in range(len(ranks[0]))]
    by = {(r["stage"], r["prefetch"]): r for r in rows}
    headline = {}
    for stage in STAGES:
        sync, over = by[(stage, 0)], by[(stage, 1)]
        headline[f"{stage}_hidden_prefetch0"] = sync["hidden_fraction"]
        headline[f"{stage}_hidden_prefetch1"] = over["hidden_fraction"]
        headline[f"{stage}_step_speedup_prefetch1"] = round(sync["step_s"] / over["step_s"], 3)
        # the same losses: overlap changes when the engine waits, not what it computes
        headline[f"{stage}_losses_equal"] = sync["losses"] == over["losses"]
    notes = [
        f"emulated link: {link_info['link']} (this core {link_info['core_fp32_flops'] / 1e9:.3g} GFLOP/s fp32 "
        f"vs {link_info['device']} {link_info['device_fp32_flops'] / 1e12:.3g} TFLOP/s)",
        "hidden_fraction = 1 - exposed / link time of the flat all-gathers and reduce-scatters per step: "
        "link time is each call's emulated transfer time, exposed the part of it training still waited "
        "for (median over timed steps of the ranks' mean; min/max over steps beside it; per op: each "
        "op's own); blocked: all seconds spent in those calls, also the real transfer and waiting for "
        "a peer slowed by other jobs on the cores",
        f"GPT-2 {cfg.n_layer} layers x {cfg.n_embd}, vocab {cfg.vocab}, {cfg.global_batch} x {cfg.seq} tokens "
        f"per step over {RANKS} ranks, AdamW, {cfg.steps} timed steps after {cfg.warmup}",
    ]
    columns = [
        "stage", "prefetch", "chunks", "step_s", "link_s_per_step", "exposed_s_per_step", "blocked_s_per_step",
        "hidden_fraction", "hidden_min", "hidden_max", "hidden_all_gather", "hidden_reduce_scatter",
    ]  # fmt: skip
    return BenchResult(
        name="overlap",
        headline=headline,
        rows=rows,
        columns=columns,
        notes=notes,
        extra={"config": asdict(cfg), "link": link_info},
    )


def plot_overlap(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hidden, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['stage']}\nprefetch {r['prefetch']}" for r in result.rows]
    xs = range(len(labels))
    ax_hidden.bar(xs, [r["hidden_fraction"] for r in result.rows])
    ax_hidden.set_xticks(list(xs), labels, fontsize=8)
    ax_hidden.set(
        ylabel="fraction of link time hidden", ylim=(0, 1), title="Communication hidden behind compute"
    )
    ax_time.bar(
        [x - 0.2 for x in xs], [r["link_s_per_step"] for r in result.rows], width=0.4, label="link time"
    )
    ax_time.bar(
        [x + 0.2 for x in xs], [r["exposed_s_per_step"] for r in result.rows], width=0.4, label="exposed"
    )
    ax_time.set_xticks(list(xs), labels, fontsize=8)
    ax_time.set(ylabel="seconds per step", title="Link time issued vs exposed")
    ax_time.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
