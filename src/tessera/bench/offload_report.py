"""`tessera bench offload`'s result: headline ratios, tables, notes and the plot, from the
ladder's rows (``tessera.bench.offload`` runs the trials)."""

from __future__ import annotations

from dataclasses import asdict

from tessera.bench.harness import BenchResult

VARIANTS = ["none", "tessera", "static", "deepspeed", "deepspeed_whole", "tessera_bf16", "deepspeed_bf16"]
LABEL = {
    "none": "no offload (ZeRO-3 in memory)",
    "static": "static offload (working set only)",
    "deepspeed": "DeepSpeed ZeRO-3 offload",
    "deepspeed_whole": "DeepSpeed ZeRO-3 offload (model built whole)",
    "tessera": "Tessera planned placement",
    "tessera_bf16": "Tessera planned placement, bf16 copies",
    "deepspeed_bf16": "DeepSpeed ZeRO-3 offload, bf16",
}


def params_of(cfg, depth: int) -> int:
    """GPT-2 parameters at ``depth`` layers of the bench config's width, vocabulary and sequence."""
    w = cfg.width
    return depth * (12 * w * w + 13 * w) + cfg.vocab * w + cfg.seq * w + 2 * w


def _common(rows, variant, depth):
    return next((r for r in rows if r["variant"] == variant and r["depth"] == depth and r["ok"]), None)


def _ratio(a, b):
    return None if a is None or b is None or not b else round(a / b, 2)


def result(cfg, rows, largest, variants, timed=None) -> BenchResult:
    size = {v: params_of(cfg, largest[v]) / 1e6 if v in largest else None for v in variants}
    at = {v: _common(timed or rows, v, cfg.common_depth) for v in variants}
    tps = {v: at[v]["tokens_per_s"] if at[v] else None for v in variants}
    moved = {v: at[v]["moved_mib_per_step"] if at[v] else None for v in variants}
    # the larger model, then (a tie: the committed run's 8 layers both ways) the faster build
    best_ds = max(("deepspeed", "deepspeed_whole"), key=lambda v: (size.get(v) or 0, tps.get(v) or 0))
    headline = {
        "budget_mib": cfg.budget_mib,
        **{f"largest_params_m_{v}": None if size[v] is None else round(size[v], 1) for v in variants},
        "largest_vs_no_offload": _ratio(size.get("tessera"), size.get("none")),
        # DeepSpeed at its best: the larger of its two ways to build the model (zero.Init, whole)
        "deepspeed_best_build": best_ds,
        "largest_vs_deepspeed": _ratio(size.get("tessera"), size.get(best_ds)),
        "largest_vs_static": _ratio(size.get("tessera"), size.get("static")),
        "largest_bf16_vs_deepspeed_bf16": _ratio(size.get("tessera_bf16"), size.get("deepspeed_bf16")),
        "moved_vs_static": _ratio(moved.get("tessera"), moved.get("static")),
        **_moved_where_both_offload(rows, largest),
        "tokens_per_s_vs_no_offload": _ratio(tps.get("tessera"), tps.get("none")),
        "tokens_per_s_vs_deepspeed": _ratio(tps.get("tessera"), tps.get(best_ds)),
        "lower_bound": {
            v: largest.get(v) == cfg.depths[-1] or any(r["variant"] == v and r.get("untried") for r in rows)
            for v in variants
        },
    }
    common = [
        {"variant": LABEL[v], "tokens_per_s": tps[v], "moved_mib_per_step": moved[v],
         "peak_mib": at[v]["peak_mib"] if at[v] else None}
        for v in variants
    ]  # fmt: skip
    notes = _notes(cfg, rows, variants, largest)
    return BenchResult(
        name="offload",
        headline=headline,
        rows=rows,
        columns=["variant", "depth", "params_m", "ok", "peak_mib", "setup_peak_mib", "charged_peak_mib",
                 "host_memory_mib", "tokens_per_s", "moved_mib_per_step", "offload_to", "why"],
        notes=notes,
        extra={"config": asdict(cfg), "common": common, "common_runs": timed or []},
        tables=[(f"At the common size (depth {cfg.common_depth}, {params_of(cfg, cfg.common_depth) / 1e6:.1f} M "
                 f"parameters; runs of their own, {cfg.common_steps - 1} timed steps after the warm-up)", ["variant", "tokens_per_s", "moved_mib_per_step", "peak_mib"], common)],
    )  # fmt: skip


def _moved_where_both_offload(rows, largest) -> dict:
    """Moved bytes at the largest depth both offloading variants trained (at the common size
    the planned placement may keep everything in memory and move nothing)."""
    if "static" not in largest or "tessera" not in largest:
        return {}
    depth = min(largest["static"], largest["tessera"])
    a, b = _common(rows, "tessera", depth), _common(rows, "static", depth)
    return {
        "moved_compare_depth": depth,
        "moved_mib_per_step_tessera": round(a["moved_mib_per_step"], 1),
        "moved_mib_per_step_static": round(b["moved_mib_per_step"], 1),
        "moved_vs_static_at_depth": _ratio(a["moved_mib_per_step"], b["moved_mib_per_step"]),
    }


def _notes(cfg, rows, variants, largest) -> list[str]:
    notes = [
        f"GPT-2 family: width {cfg.width}, {cfg.heads} heads, vocabulary {cfg.vocab}, sequence {cfg.seq}, batch "
        f"{cfg.batch}, depth grown along {list(cfg.depths)}; AdamW (torch fused CPU kernel for Tessera), fp32, "
        f"activation checkpointing {'on (every variant)' if cfg.activation_checkpointing else 'off'}, "
        + (
            f"activations measured first: {cfg.act_fixed_mib:.1f} MiB + {cfg.act_per_layer_mib:.2f} MiB per layer, "
            if cfg.act_per_layer_mib is not None
            else "activations estimated (dry run formula), "
        )
        + f"{cfg.threads} threads, 1 process; {cfg.steps} steps per trial (the first is the warm-up).",
        "The same rule for every variant: each trial imports torch, transformers and DeepSpeed (where installed) "
        "and joins a one-rank gloo process group before its baseline is taken, whether it uses them or not.",
        f"Budget: {cfg.budget_mib} MiB of resident memory for the whole trial, set-up included: the steps' "
        "high-water mark (VmHWM after a reset once the model is set up) and set-up's must both stay under it. "
        + _limit_note(rows),
        "No variant builds the model whole: Tessera's are built on the meta device (accelerate's "
        "init_empty_weights) and made chunk by chunk by boost; DeepSpeed's are partitioned as they are built "
        "(deepspeed.zero.Init through transformers' HfDeepSpeedConfig, as transformers documents for ZeRO-3).",
        "Depth: the ladder up to the first miss, then bisected between the last depth that fits and that miss.",
    ]
    if not any(v.startswith("deepspeed") for v in variants):
        notes.append(
            "DeepSpeed is not installed (optional extra: pip install '.[deepspeed]'): its rows are absent."
        )
    else:
        to = {
            r.get("offload_to") for r in rows if r["variant"].startswith("deepspeed") and r.get("offload_to")
        }
        notes.append(
            f"DeepSpeed ZeRO-3 offloaded parameters and optimizer states to {', '.join(sorted(to)) or 'nothing (it failed)'}"
            " (nvme needs its async I/O op, which needs libaio; without it, to host memory, which on a CPU-only "
            "machine is the memory it computes in)."
        )
    for v in variants:
        untried = any(r["variant"] == v and r.get("untried") for r in rows)
        if largest.get(v) == cfg.depths[-1] or untried:
            why = "reached the top of the ladder" if not untried else "ran out of its time before a miss"
            notes.append(f"{LABEL[v]} {why}: its largest size is a lower bound.")
    return notes


def _limit_note(rows) -> str:
    how = sorted({r["limit"] for r in rows if r.get("limit")})
    if how and all(not h.startswith("not applied") for h in how):
        return (
            f"Hard limit: {'; '.join(how)} per trial (a trial over it is killed; charged_peak_mib is the group's "
            "high-water mark, which also counts the page cache of the disk tier's files)."
        )
    return "No hard limit: " + ("; ".join(how) or "none tried") + ". The high-water marks are the check."


def plot_offload(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in result.rows)]
    sizes = [result.headline.get(f"largest_params_m_{v}") or 0 for v in variants]
    a.bar([LABEL[v].split(" (")[0] for v in variants], sizes, color="tab:blue")
    a.set_ylabel("largest model trained (M parameters)")
    a.set_title(f"under a {result.headline['budget_mib']} MiB resident budget")
    a.tick_params(axis="x", rotation=20)
    for v in variants:
        pts = [(r["params_m"], r["peak_mib"]) for r in result.rows if r["variant"] == v and "peak_mib" in r]
        if pts:
            b.plot(*zip(*pts, strict=True), marker="o", label=LABEL[v])
    b.axhline(result.headline["budget_mib"], color="k", ls="--", label="budget")
    b.set_xlabel("model (M parameters)")
    b.set_ylabel("resident peak of the steps (MiB)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
