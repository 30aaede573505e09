"""The report of `tessera bench train`: each variant's row (median and range over the
repeats), the headline ratios against FSDP2 and DeepSpeed, the notes and the plot."""

from __future__ import annotations

import statistics

from tessera.bench.harness import BenchResult
from tessera.bench.train_config import HEADLINE_STAGES, LR, RANKS, MiB, TrainBenchConfig, deepspeed_config
from tessera.train.gpt2_text import flops_per_token


def _spread(values: list[float]) -> dict:
    """Median, range and the range as a percentage of the median (of the largest value when the
    median is 0: a --quick model's peak can stay inside the resident set taken as its baseline)."""
    mid = statistics.median(values)
    width = max(values) - min(values)
    return {
        "median": mid,
        "min": min(values),
        "max": max(values),
        "spread_pct": 100 * width / (mid or max(values) or 1.0),
    }


def _row(variant: str, repeats: list[list[dict]], cfg: TrainBenchConfig, params: int, peak: float) -> dict:
    tokens = cfg.global_batch * cfg.seq * cfg.steps
    speeds = [tokens / max(r["seconds"] for r in ranks) for ranks in repeats]
    mems = [max(r["peak_mib"] for r in ranks) for ranks in repeats]
    state = {k: max(r["state_bytes"][k] for r in repeats[0]) / MiB for k in ("params", "grads", "optimizer")}
    speed, mem = _spread(speeds), _spread(mems)
    achieved = speed["median"] * flops_per_token(params, cfg.n_layer, cfg.n_embd, cfg.seq)
    return {
        "variant": variant,
        "tokens_per_s": round(speed["median"], 1),
        "tokens_per_s_range": [round(speed["min"], 1), round(speed["max"], 1)],
        "tokens_per_s_spread_pct": round(speed["spread_pct"], 1),
        "peak_mib_per_rank": round(mem["median"], 1),
        "peak_mib_range": [round(mem["min"], 1), round(mem["max"], 1)],
        "model_state_mib_per_rank": round(sum(state.values()), 1),
        "params_mib": round(state["params"], 1),
        "grads_mib": round(state["grads"], 1),
        "optimizer_mib": round(state["optimizer"], 1),
        "chunks_per_rank": repeats[0][0]["chunks"],
        "achieved_gflops": round(achieved / 1e9, 2),
        "mfu": round(achieved / peak, 4),
        "final_loss": statistics.mean(r["loss"] for r in repeats[0]),  # mean over the ranks' shares
        "comm_mib_per_step": {k: round(v / MiB, 2) for k, v in repeats[0][0]["comm_bytes_per_step"].items()},
        "speeds": speeds,
        "mems": mems,
    }


def _headline(by: dict[str, dict]) -> dict:
    """Tessera ZeRO-1/2/3 over FSDP2 and over DeepSpeed: ratio of the medians, and the range of
    the per-repeat ratios (repeats are interleaved, so repeat i of both ran side by side)."""
    out = {}
    for stage, variant in HEADLINE_STAGES.items():
        for base in ("fsdp2", "deepspeed_zero3"):
            if variant not in by or base not in by:
                continue
            for metric, key in (("tokens_per_s", "speeds"), ("peak_mem", "mems")):
                column = "tokens_per_s" if metric == "tokens_per_s" else "peak_mib_per_rank"
                name = f"zero{stage}_{metric}_vs_{base}"
                if by[base][column] <= 0 or min(by[base][key]) <= 0:
                    # a tiny (--quick) model's peak can stay within the baseline's resident set:
                    # no ratio to give
                    out[name] = out[name + "_range"] = None
                    continue
                ratios = [a / b for a, b in zip(by[variant][key], by[base][key], strict=True)]
                out[name] = round(by[variant][column] / by[base][column], 3)
                out[name + "_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return out


def _notes(cfg: TrainBenchConfig, params: int, peak: float, have_deepspeed: bool) -> list[str]:
    zero = deepspeed_config(cfg, cfg.global_batch // RANKS)["zero_optimization"]
    notes = [
        f"GPT-2 ({cfg.n_layer} layers, {cfg.n_embd} wide, {cfg.n_head} heads, vocab {cfg.vocab}, {params:,} parameters), "
        f"sequence {cfg.seq}, global batch {cfg.global_batch}, AdamW (lr {LR}), fp32; {RANKS} gloo ranks x 1 thread; "
        f"{cfg.warmup} warm-up + {cfg.steps} timed steps; {cfg.repeats} interleaved repeats: median, [min, max].",
        "FSDP2: fully_shard per transformer block and the root. Tessera: block_chunks (a chunk per block, "
        "the rest as FSDP2's root holds it), and ZeRO-3 also with 32 MiB chunks across blocks (tessera_zero3_32mib).",
        "DeepSpeed ZeRO-3 (its HuggingFace integration's values for hidden size h): "
        + ", ".join(f"{k}={v}" for k, v in zero.items() if k != "stage"),
        f"MFU against a measured fp32 matmul peak of {peak / 1e9:.1f} GFLOP/s ({RANKS} ranks x 1 thread).",
        "peak_mib_per_rank: resident high-water mark above a baseline taken after every import (torch, "
        "transformers, DeepSpeed) and before the model is built. params/grads/optimizer_mib: bytes of the "
        "distinct storages each framework holds after a step, counted exactly (communication buckets, "
        "activations and allocator slack are not model state).",
    ]
    if not have_deepspeed:
        notes.append(
            "DeepSpeed is not installed (optional extra: pip install '.[deepspeed]'): its row is absent."
        )
    return notes


def plot_train(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows
    names = [r["variant"] for r in rows]
    colors = ["#1f77b4" if n.startswith("tessera") else "#7f7f7f" for n in names]
    from tessera.bench.checkpoint import draw

    section = result.extra.get("checkpoint")
    fig = plt.figure(figsize=(15, 8.5 if section else 4.5))
    top = fig.add_gridspec(2 if section else 1, 3)
    ax_t = fig.add_subplot(top[0, 0])
    ax_m, ax_s = fig.add_subplot(top[0, 1], sharey=ax_t), fig.add_subplot(top[0, 2], sharey=ax_t)
    for ax in (ax_m, ax_s):
        ax.tick_params(labelleft=False)
    if section:
        draw(fig.add_subplot(top[1, 0]), fig.add_subplot(top[1, 1]), section["rows"], section["recovery"])
    speed = [r["tokens_per_s"] for r in rows]
    err = [
        [s - r["tokens_per_s_range"][0] for s, r in zip(speed, rows, strict=True)],
        [r["tokens_per_s_range"][1] - s for s, r in zip(speed, rows, strict=True)],
    ]
    ax_t.barh(names, speed, xerr=err, color=colors)
    ax_t.set(title="training throughput (median, range)", xlabel=f"tokens / s ({RANKS} ranks)")
    ax_m.barh(names, [r["peak_mib_per_rank"] for r in rows], color=colors)
    ax_m.set(title="peak resident memory per rank", xlabel="MiB above the post-import baseline")
    left = [0.0] * len(rows)
    for kind, color in (("params_mib", "#4c72b0"), ("grads_mib", "#dd8452"), ("optimizer_mib", "#55a868")):
        values = [r[kind] for r in rows]
        ax_s.barh(names, values, left=left, color=color, label=kind.removesuffix("_mib"))
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax_s.set(title="model state per rank", xlabel="MiB")
    ax_s.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
