"""`tessera bench moe`: a small Mixtral (8 experts, top-2; 4 layers 256 wide, each expert's
MLP 512 wide, ~14M parameters of which ~90% are experts) trained on 2 ranks (gloo, 1 thread
each) with its own load-balancing loss, under expert parallelism against data parallelism
with ZeRO-3, every variant in the same run:

- ``dp2_zero3``: the baseline, every parameter sharded over the 2 ranks, gathered per block;
- ``ep2``: ``Plan(dp=2, ep=2)``: each rank holds 4 of the 8 experts of every layer whole, the
  tokens travel to their experts by all-to-all; the rest replicated (ZeRO-0);
- ``ep2_zero3``: the same with the dense parameters sharded too (the experts' edp group is
  one rank, so they stay whole);
- ``dp2_zero0``: plain data parallelism (every rank holds everything), for scale.

Per variant, three interleaved repeats (repeat 1 of every variant, then repeat 2, ...), each
in freshly spawned processes: tokens/s over the timed steps after a warm-up (median and range
over the repeats); peak resident memory per rank as the high-water mark above a baseline
taken after the imports and before the model is built (``VmHWM``, freed blocks returned to
the OS by ``MALLOC_MMAP_THRESHOLD_``), and the model state each rank holds (parameters,
gradients, Adam moments: distinct storages, counted exactly). For the expert-parallel
variants: the all-to-all bytes each rank's ledger counted per step against
``a2a_bytes`` of the (token, expert) pairs its dispatches sent and received that step (the
formula of ``tessera.parallel.expert_costs``), and against the planner's balanced estimate
(``balanced_a2a_bytes_per_rank``, exact for the mean over the ranks); and the tokens each
expert received per step over training (summed over the ranks: the load balance the
router's auxiliary loss works towards).

``--quick``: a tiny model, one repeat, every variant, well under two minutes.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from tessera.bench.harness import BenchResult

MiB = 2**20
RANKS = 2
LR = 1e-3


@dataclass(frozen=True)
class MoeBenchConfig:
    hidden: int = 256
    expert_width: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    experts: int = 8
    top_k: int = 2
    vocab: int = 2048
    seq: int = 128
    global_batch: int = 8
    warmup: int = 2
    steps: int = 16
    repeats: int = 3
    aux_coef: float = 0.02  # router_aux_loss_coef (Mixtral's default is 0.001; larger to show it)


FULL = MoeBenchConfig()
QUICK = MoeBenchConfig(
    hidden=64, expert_width=128, layers=2, heads=4, kv_heads=2, vocab=512, seq=32, global_batch=4,
    warmup=1, steps=3, repeats=1,
)  # fmt: skip
VARIANTS = {  # variant -> Plan settings beside dp=2
    "dp2_zero3": dict(zero=3, block_chunks=True),
    "ep2": dict(ep=2),
    "ep2_zero3": dict(ep=2, zero=3, block_chunks=True),
    "dp2_zero0": dict(),
}
BASELINE = "dp2_zero3"


def moe_model(cfg: MoeBenchConfig):
    """The benchmark's Mixtral, from a config (no download), seeded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "mixtral",
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.expert_width,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq,
        num_local_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=cfg.aux_coef,
        attn_implementation="sdpa",
    )
    return AutoModelForCausalLM.from_config(config)


def moe_loss(model, batch):
    """The model's own loss: next-token cross-entropy + router_aux_loss_coef x load balance."""
    return model(input_ids=batch, labels=batch, output_router_logits=True).loss


def _batches(cfg: MoeBenchConfig) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, cfg.vocab, (cfg.global_batch, cfg.seq), generator=g)
        for _ in range(cfg.warmup + cfg.steps)
    ]


def _rank_run(variant: str, cfg: MoeBenchConfig) -> dict:
    import torch.distributed as dist
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401  (imports are not training memory)

    import tessera
    from tessera.bench.train import _local, _optimizer_tensors, state_bytes
    from tessera.memory.track import reset_peak_rss, status_kib
    from tessera.parallel.expert_costs import a2a_bytes
    from tessera.parallel.experts import dispatches
    from tessera.runtime import Mesh

    batches = _batches(cfg)
    gc.collect()
    before = reset_peak_rss()
    model = moe_model(cfg)
    mesh = Mesh(dp=RANKS)
    plan = tessera.Plan(dp=RANKS, **VARIANTS[variant])
    model, opt = tessera.boost(model, torch.optim.AdamW(model.parameters(), lr=LR), plan, mesh)
    ledger, found = mesh.comm.ledger, dispatches(model)
    steps = []  # per step: a2a bytes counted, by formula, tokens per expert per layer
    began = None
    for i, tokens in enumerate(batches):
        if i == cfg.warmup:
            ledger.reset()
            dist.barrier()
            began = time.perf_counter()
        for d in found:
            d.reset_counts()
        moved = ledger.total(op="all_to_all", axis="ep")
        loss = opt.train_step(tokens, moe_loss)["loss"]
        steps.append(
            {
                "loss": loss,
                "a2a_bytes": ledger.total(op="all_to_all", axis="ep") - moved,
                "a2a_formula": sum(
                    a2a_bytes(cfg.experts, d.pairs_sent, d.pairs_received, cfg.hidden) for d in found
                ),
                "tokens_per_expert": [d.tokens_per_expert.tolist() for d in found],
            }
        )
    dist.barrier()
    seconds = time.perf_counter() - began
    params = list(model.parameters())
    roots = {
        "params": [_local(p) for p in params] + opt.engine.shards,
        "grads": [p.grad for p in params] + [s.grad for s in opt.engine.shards],
        "optimizer": _optimizer_tensors(opt.inner),
    }
    return {
        "seconds": seconds,
        "peak_mib": (status_kib("VmHWM") - before) / 1024,
        "state_bytes": state_bytes(roots),
        "steps": steps,
        "comm_bytes_per_step": {k: v["bytes"] / cfg.steps for k, v in ledger.snapshot().items()},
    }


def _spread(values: list[float]) -> dict:
    mid = statistics.median(values)
    return {"median": mid, "min": min(values), "max": max(values)}


def _row(variant: str, repeats: list[list[dict]], cfg: MoeBenchConfig) -> dict:
    from tessera.parallel.expert_costs import balanced_a2a_bytes_per_rank

    tokens = cfg.global_batch * cfg.seq * cfg.steps
    speeds = [tokens / max(r["seconds"] for r in ranks) for ranks in repeats]
    mems = [max(r["peak_mib"] for r in ranks) for ranks in repeats]
    state = {k: max(r["state_bytes"][k] for r in repeats[0]) / MiB for k in ("params", "grads", "optimizer")}
    speed, mem = _spread(speeds), _spread(mems)
    timed = [s for ranks in repeats for r in ranks for s in r["steps"][cfg.warmup :]]
    row = {
        "variant": variant,
        "plan": "Plan(" + ", ".join(f"{k}={v}" for k, v in {"dp": RANKS, **VARIANTS[variant]}.items()) + ")",
        "tokens_per_s": round(speed["median"], 1),
        "tokens_per_s_range": [round(speed["min"], 1), round(speed["max"], 1)],
        "peak_mib_per_rank": round(mem["median"], 1),
        "peak_mib_range": [round(mem["min"], 1), round(mem["max"], 1)],
        "model_state_mib_per_rank": round(sum(state.values()), 2),
        "params_mib": round(state["params"], 2),
        "grads_mib": round(state["grads"], 2),
        "optimizer_mib": round(state["optimizer"], 2),
        "final_loss": round(statistics.mean(r["steps"][-1]["loss"] for r in repeats[0]), 4),
        "comm_mib_per_step": {k: round(v / MiB, 3) for k, v in repeats[0][0]["comm_bytes_per_step"].items()},
        "speeds": speeds,
        "mems": mems,
    }
    if "ep" in VARIANTS[variant]:
        local = cfg.global_batch // RANKS * cfg.seq
        planner = cfg.layers * balanced_a2a_bytes_per_rank(cfg.experts, local, cfg.top_k, cfg.hidden)
        measured = [s["a2a_bytes"] for s in timed]
        row |= {
            "a2a_mib_per_step": round(statistics.mean(measured) / MiB, 4),
            "a2a_equals_formula": all(s["a2a_bytes"] == s["a2a_formula"] for s in timed),
            "a2a_steps_checked": len(timed),
            "a2a_planner_mib_per_step": round(planner / MiB, 4),
            "a2a_mean_over_ranks_vs_planner": round(statistics.mean(measured) / planner, 6),
        }
    return row


def _load_balance(runs: list[dict], cfg: MoeBenchConfig) -> list[dict]:
    """Per step of one expert-parallel run: the tokens each expert got (summed over the
    ranks and layers) and the largest expert's share over the mean (1.0: balanced)."""
    out = []
    for step in range(cfg.warmup + cfg.steps):
        layers = [
            [sum(r["steps"][step]["tokens_per_expert"][layer][e] for r in runs) for e in range(cfg.experts)]
            for layer in range(cfg.layers)
        ]
        per_expert = [sum(layer[e] for layer in layers) for e in range(cfg.experts)]
        worst = max(max(layer) / (sum(layer) / cfg.experts) for layer in layers)
        out.append(
            {
                "step": step,
                "tokens_per_expert": per_expert,
                "max_over_mean": round(max(per_expert) / (sum(per_expert) / cfg.experts), 3),
                "worst_layer_max_over_mean": round(worst, 3),
                "loss": round(statistics.mean(r["steps"][step]["loss"] for r in runs), 4),
            }
        )
    return out


def _headline(by: dict[str, dict], balance: list[dict]) -> dict:
    """ep2 over dp2 ZeRO-3: ratio of the medians and the range of the per-repeat ratios
    (repeat i of both ran side by side)."""
    out = {}
    for variant in ("ep2", "ep2_zero3"):
        if variant not in by or BASELINE not in by:
            continue
        for metric, key, column in (
            ("tokens_per_s", "speeds", "tokens_per_s"),
            ("peak_mem", "mems", "peak_mib_per_rank"),
        ):
            # A tiny quick model can stay under the baseline's resident set (0 MiB above it):
            # no ratio is defined then, and the headline says None rather than dividing by zero.
            pairs = list(zip(by[variant][key], by[BASELINE][key], strict=True))
            ratios = [a / b for a, b in pairs if b > 0]
            base = by[BASELINE][column]
            out[f"{variant}_{metric}_vs_{BASELINE}"] = round(by[variant][column] / base, 3) if base > 0 else None
            out[f"{variant}_{metric}_vs_{BASELINE}_range"] = (
                [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None
            )
    if "ep2" in by:
        out["a2a_bytes_equal_formula"] = by["ep2"]["a2a_equals_formula"]
        out["a2a_mib_per_step"] = by["ep2"]["a2a_mib_per_step"]
    if balance:
        out["load_max_over_mean_first_step"] = balance[0]["max_over_mean"]
        out["load_max_over_mean_last_step"] = balance[-1]["max_over_mean"]
    return out


def run_moe_bench(
    *, quick: bool, variants: list[str] | None = None, cfg: MoeBenchConfig | None = None
) -> BenchResult:
    from tessera.runtime import spawn

    cfg = cfg or (QUICK if quick else FULL)
    chosen = list(variants or VARIANTS)
    unknown = set(chosen) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown moe bench variants {sorted(unknown)}; known: {list(VARIANTS)}")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # the ranks inherit it
    model = moe_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    runs: dict[str, list] = {v: [] for v in chosen}
    for _ in range(cfg.repeats):  # interleaved: every variant once, then again
        for variant in chosen:
            runs[variant].append(spawn(_rank_run, RANKS, variant, cfg, timeout_s=1800))
    rows = [_row(v, runs[v], cfg) for v in chosen]
    by = {r["variant"]: r for r in rows}
    balance = _load_balance(runs["ep2"][0], cfg) if "ep2" in runs else []
    headline = _headline(by, balance)
    for row in rows:
        del row["speeds"], row["mems"]
    return BenchResult(
        name="moe",
        headline=headline,
        rows=rows,
        columns=[
            "variant",
            "plan",
            "tokens_per_s",
            "tokens_per_s_range",
            "peak_mib_per_rank",
            "peak_mib_range",
            "model_state_mib_per_rank",
            "params_mib",
            "optimizer_mib",
            "a2a_mib_per_step",
            "a2a_equals_formula",
            "a2a_planner_mib_per_step",
            "final_loss",
        ],
        tables=[
            (
                "Load balance over training (ep2, repeat 1; tokens per expert summed over ranks and layers)",
                ["step", "loss", "max_over_mean", "worst_layer_max_over_mean", "tokens_per_expert"],
                balance,
            )
        ],
        notes=_notes(cfg, params, experts),
        extra={
            "config": asdict(cfg),
            "parameters": params,
            "expert_parameters": experts,
            "load_balance": balance,
        },
    )


def _notes(cfg: MoeBenchConfig, params: int, experts: int) -> list[str]:
    return [
        f"Mixtral ({cfg.layers} layers, {cfg.hidden} wide, {cfg.heads} heads / {cfg.kv_heads} kv, {cfg.experts} "
        f"experts of {cfg.expert_width}, top-{cfg.top_k}, vocab {cfg.vocab}): {params:,} parameters, {experts:,} "
        f"of them experts; sequence {cfg.seq}, global batch {cfg.global_batch} (random tokens), AdamW (lr {LR}), "
        f"fp32, the model's loss with router_aux_loss_coef {cfg.aux_coef}; {RANKS} gloo ranks x 1 thread; "
        f"{cfg.warmup} warm-up + {cfg.steps} timed steps; {cfg.repeats} interleaved repeats: median, [min, max].",
        "peak_mib_per_rank: resident high-water mark above a baseline taken after the imports and before the "
        "model is built. model_state/params/optimizer_mib: bytes of the distinct storages each rank holds after "
        "a step, counted exactly.",
        "a2a_equals_formula: on every timed step of every repeat and rank, the all-to-all bytes the ledger "
        "counted equal a2a_bytes (8E + 2(S+R)H x 4 per layer) of the pairs the rank's dispatches sent (S) and "
        "received (R). a2a_planner_mib_per_step: the planner's estimate (each rank sends and receives top-k "
        "pairs per token), exact for the mean over the ranks; one rank's own differs with the routing.",
        "ep2's experts are whole on their rank (edp = 1), so ep2_zero3 shards only the dense parameters.",
    ]


def plot_moe(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows
    names = [r["variant"] for r in rows]
    colors = ["#1f77b4" if n.startswith("ep") else "#7f7f7f" for n in names]
    fig, (ax_t, ax_m, ax_b) = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, key, span, label in (
        (ax_t, "tokens_per_s", "tokens_per_s_range", "tokens/s (2 ranks)"),
        (ax_m, "peak_mib_per_rank", "peak_mib_range", "peak MiB per rank"),
    ):
        values = [r[key] for r in rows]
        low = [v - r[span][0] for v, r in zip(values, rows, strict=True)]
        high = [r[span][1] - v for v, r in zip(values, rows, strict=True)]
        ax.bar(names, values, color=colors, yerr=[low, high], capsize=4)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=20)
    state = [r["model_state_mib_per_rank"] for r in rows]
    ax_m.plot(names, state, "k_", markersize=30, label="model state (exact)")
    ax_m.legend(loc="upper right")
    balance = result.extra.get("load_balance", [])
    if balance:
        steps = [b["step"] for b in balance]
        experts = len(balance[0]["tokens_per_expert"])
        for e in range(experts):
            ax_b.plot(steps, [b["tokens_per_expert"][e] for b in balance], label=f"expert {e}")
        ax_b.set_xlabel("step (ep2, repeat 1)")
        ax_b.set_ylabel("tokens routed (all ranks, all layers)")
        ax_b.legend(fontsize=7, ncol=2)
    fig.suptitle("mixture of experts on 2 ranks: expert parallel vs ZeRO-3")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
