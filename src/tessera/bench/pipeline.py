"""`tessera bench pipeline`: pipeline schedules and sequence parallel, measured.

Pipeline (2 ranks, a GPT-2-style model): for GPipe, 1F1B and interleaved 1F1B (2 virtual
stages a rank), the step time, the bubble fraction measured as 1 - (m micro-batches x the
stage's own forward + backward, timed alone) / step time, beside the formula
(p-1)/(m+p-1) (interleaved: (p-1)/(v m + p - 1)), the peak tensor memory of each stage
during a step (tessera.memory.track.TensorMemory), and tokens/s against plain data parallel
over the same 2 ranks.

Sequence parallel: the longest sequence that trains (forward + backward) within the peak
tensor memory one rank needs at the base length, on 1 rank and on 2 ranks (Ring, zig-zag),
and tokens/s at the base length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessera.bench.harness import BenchResult
from tessera.runtime import Mesh, spawn


@dataclass(frozen=True, kw_only=True)
class PipelineBenchPlan:
    layers: int = 8
    hidden: int = 256
    heads: int = 8
    vocab: int = 4096
    seq: int = 128
    batch: int = 16
    microbatches: int = 8
    steps: int = 4
    sp_base: int = 1024  # sequence length whose 1-rank peak is the memory budget
    sp_step: int = 64
    sp_max: int = 2560


FULL = PipelineBenchPlan()
QUICK = PipelineBenchPlan(
    layers=4,
    hidden=64,
    heads=4,
    vocab=256,
    batch=8,
    microbatches=4,
    steps=2,
    sp_base=128,
    sp_step=64,
    sp_max=512,
)


def _model(plan: PipelineBenchPlan, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=plan.layers, n_embd=plan.hidden, n_head=plan.heads, vocab_size=plan.vocab, n_positions=seq,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def lm_loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _batch(plan: PipelineBenchPlan, seq: int, batch: int):
    ids = torch.randint(0, plan.vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


def _stage_alone(module, plan: PipelineBenchPlan, first: bool) -> float:
    """Seconds of one micro-batch's forward + backward through this stage, no pipeline."""
    mb = plan.batch // plan.microbatches
    x = _batch(plan, plan.seq, mb)[0] if first else torch.randn(mb, plan.seq, plan.hidden, requires_grad=True)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        module(x).float().sum().backward()
        best = min(best, time.perf_counter() - t)
    return best


def _pipeline_rank(plan: PipelineBenchPlan, schedule: str, virtual: int) -> dict:
    from tessera.memory.track import TensorMemory
    from tessera.parallel.pipeline import PipelineTrainer

    mesh = Mesh(pp=2)
    trainer = PipelineTrainer(
        _model(plan, plan.seq),
        mesh,
        lm_loss,
        microbatches=plan.microbatches,
        schedule=schedule,
        virtual_stages=virtual,
    )
    ids, labels = _batch(plan, plan.seq, plan.batch)
    opt = torch.optim.SGD(trainer.parameters(), lr=0.0)  # as the dp baseline steps one

    def step():
        trainer.step(ids, labels)
        opt.step()
        opt.zero_grad()

    step()  # warm-up
    times = []
    for _ in range(plan.steps):
        torch.distributed.barrier()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    with TensorMemory() as mem:
        step()
    alone = sum(_stage_alone(m, plan, m.first) for m in trainer.modules)
    return {"step_s": sorted(times)[len(times) // 2], "alone_s": alone, "peak_mib": mem.peak / 2**20}


def _dp_rank(plan: PipelineBenchPlan) -> dict:
    import tessera
    from tessera.train.losses import causal_lm_loss

    mesh = Mesh(dp=2)
    model = _model(plan, plan.seq)
    model, opt = tessera.boost(model, torch.optim.SGD(model.parameters(), lr=0.0), tessera.Plan(dp=2), mesh)
    ids = _batch(plan, plan.seq, plan.batch)[0]
    opt.train_step(ids, causal_lm_loss)
    times = []
    for _ in range(plan.steps):
        t = time.perf_counter()
        opt.train_step(ids, causal_lm_loss)
        times.append(time.perf_counter() - t)
    return {"step_s": sorted(times)[len(times) // 2]}


def _sp_peak(plan: PipelineBenchPlan, seq: int) -> dict:
    """Peak tensor memory and seconds of one forward + backward at ``seq`` on this world."""
    from tessera.memory.track import TensorMemory
    from tessera.parallel.sequence import SequenceParallel

    world = torch.distributed.get_world_size()
    mesh = Mesh(sp=world)
    model = _model(plan, seq)
    ids = _batch(plan, seq, 1)[0]
    sp = SequenceParallel(model, mesh.comm, "sp", "ring")
    with TensorMemory() as mem:
        sp.loss(ids).backward()
    t = time.perf_counter()
    sp.loss(ids).backward()
    return {"peak_mib": mem.peak / 2**20, "seconds": time.perf_counter() - t}


def _sp_scan(plan: PipelineBenchPlan, budget_mib: float) -> dict:
    """The longest length in steps of ``sp_step`` whose per-rank peak stays in budget."""
    best, seen = None, []
    seq = plan.sp_base
    while seq <= plan.sp_max:
        got = _sp_peak(plan, seq)
        seen.append({"seq": seq, **got})
        if got["peak_mib"] > budget_mib:
            break
        best = seq
        seq += plan.sp_step
    return {"longest": best, "tried": seen}


def run_pipeline_bench(quick: bool = False) -> BenchResult:
    plan = QUICK if quick else FULL
    rows = []
    tokens = plan.batch * plan.seq
    dp = spawn(_dp_rank, 2, plan, timeout_s=1800)[0]
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        ranks = spawn(_pipeline_rank, 2, plan, schedule, virtual, timeout_s=1800)
        step = max(r["step_s"] for r in ranks)
        p, m = 2, plan.microbatches
        formula = (p - 1) / (virtual * m + p - 1)
        measured = 1 - max(r["alone_s"] * m for r in ranks) / step
        rows.append(
            {
                "schedule": f"{schedule}" + (f" (v={virtual})" if virtual > 1 else ""),
                "step_s": round(step, 4),
                "bubble_measured": round(measured, 3),
                "bubble_formula": round(formula, 3),
                "peak_mib_stage0": round(ranks[0]["peak_mib"], 1),
                "peak_mib_stage1": round(ranks[1]["peak_mib"], 1),
                "tokens_per_s": round(tokens / step, 1),
                "vs_dp2": round(dp["step_s"] / step, 3),
            }
        )
    budget = spawn(_sp_peak, 1, plan, plan.sp_base)[0]["peak_mib"]
    one = spawn(_sp_scan, 1, plan, budget, timeout_s=1800)[0]
    two = spawn(_sp_scan, 2, plan, budget, timeout_s=1800)[0]
    ratio = two["longest"] / one["longest"] if one["longest"] and two["longest"] else None
    headline = {
        "bubble_1f1b_measured": rows[1]["bubble_measured"],
        "bubble_1f1b_formula": rows[1]["bubble_formula"],
        "peak_mib_stage0_1f1b_vs_gpipe": round(rows[1]["peak_mib_stage0"] / rows[0]["peak_mib_stage0"], 3),
        "pp2_tokens_per_s_vs_dp2": rows[1]["vs_dp2"],
        "sp2_longest_sequence_ratio": None if ratio is None else round(ratio, 3),
    }
    notes = [
        f"GPT-2 style {plan.layers} layers x {plan.hidden}, vocab {plan.vocab}, sequence {plan.seq}, batch {plan.batch} "
        f"in {plan.microbatches} micro-batches; 2 gloo ranks x 1 thread; {plan.steps} timed steps, median",
        "bubble measured = 1 - m x (a stage's forward + backward of one micro-batch, timed alone) / step time; "
        "it also holds the p2p and scheduling overheads the formula leaves out",
        f"sequence parallel: budget = the 1-rank peak tensor memory at {plan.sp_base} tokens ({budget:.1f} MiB); "
        f"longest that fits: 1 rank {one['longest']}, 2 ranks (ring, zig-zag) {two['longest']} (step {plan.sp_step}, max {plan.sp_max})",
    ]
    return BenchResult(
        name="pipeline",
        headline=headline,
        rows=rows,
        columns=list(rows[0]),
        notes=notes,
        extra={
            "plan": vars(plan),
            "dp2_step_s": dp["step_s"],
            "sp_one_rank": one,
            "sp_two_ranks": two,
            "sp_budget_mib": budget,
        },
    )


def plot_pipeline(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["schedule"] for r in result.rows]
    x = range(len(names))
    a.bar([i - 0.2 for i in x], [r["bubble_measured"] for r in result.rows], 0.4, label="measured")
    a.bar([i + 0.2 for i in x], [r["bubble_formula"] for r in result.rows], 0.4, label="formula")
    a.set(xticks=list(x), xticklabels=names, ylabel="bubble fraction", title="pipeline bubble, 2 stages")
    a.legend()
    for key, label in (("sp_one_rank", "1 rank"), ("sp_two_ranks", "2 ranks, ring")):
        tried = result.extra[key]["tried"]
        b.plot([t["seq"] for t in tried], [t["peak_mib"] for t in tried], "o-", label=label)
    b.axhline(result.extra["sp_budget_mib"], color="k", lw=0.8, ls="--", label="budget")
    b.set(xlabel="sequence length", ylabel="peak tensor MiB per rank", title="sequence parallel")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
