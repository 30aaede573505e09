"""`tessera bench plan`: the planner's predictions against what was measured.

1. This machine: every row of the committed `tessera bench dit` (loopback) and `tessera
   bench train` results, predicted with this CPU's measured profile (fp32 matmul peak per
   thread, copy bandwidth) and a loopback link measured here with two gloo ranks; each
   table calibrated on its serial (dit) or DDP (train) row. Only real transfers count as
   this machine: bench dit's emulated-link rows wait on transfers timed by the same link
   model the planner predicts with, so they are reported apart ("emulated link") and are
   not counted in this machine's figures.
2. Published: every row of the numeric latency tables xDiT publishes
   (tessera.plan.published), predicted from the stated hardware's datasheet profile and
   link, each table calibrated on its one-GPU row. The host seconds per eager op are
   fitted on the FLUX PyTorch table alone; the other tables are predicted with them. These
   tables were looked at while the decode and host-floor terms were added: in sample.
3. Published scale: PatrickStar's and Colossal-AI's largest-model and throughput figures
   (tessera.plan.published_scale, tessera.plan.check_scale).
4. Out of sample (tessera.plan.out_of_sample): published rows added after the model was
   frozen at a named commit, written to plan-out-of-sample.json / .md.
5. Every fitted number, with the table it was fitted on (``fitted_parameters``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from tessera.bench.dit import LAYOUTS  # the layouts bench dit measured, by name
from tessera.bench.harness import BenchResult, matmul_peak_flops
from tessera.plan import out_of_sample
from tessera.plan.check import calibrate, check_generate_rows, check_published, compare, fit_host_op_seconds
from tessera.plan.check_scale import scale_checks, scale_tables
from tessera.plan.devices import DeviceProfile, save_profile
from tessera.plan.hardware import Hardware
from tessera.plan.model_presets import PRESETS
from tessera.plan.model_spec import gpt2_spec
from tessera.plan.published import TABLES
from tessera.plan.training import predict_train
from tessera.runtime import spawn
from tessera.runtime.link import Link, link_named
from tessera.train.plan import Plan

RESULTS = Path("benchmarks/results")
THIS_MACHINE = "this machine"
# the waits of these rows come from tessera.runtime.link's model, the one the planner uses
EMULATED = "emulated link (waits from the link model)"
IN_SAMPLE = "published (seen while terms were added)"
FIT = "published (fit)"
# Terms added to the model after a table was seen (that table then no longer tests them).
TERMS_ADDED_AFTER_SEEING = [
    {
        "parameter": "host floor: seconds per eager op x aten ops per layer",
        "value": "fitted (below); ops counted on diffusers' blocks",
        "fitted_on": "xDiT flux.md PyTorch table (added after its 1/5 rows)",
    },
    {
        "parameter": "VAE decode term (decode FLOPs once on one rank)",
        "value": "counted on the meta device, not fitted",
        "fitted_on": "added after xDiT sana.md (DC-AE at 4096 px) was seen: SANA's 8-GPU rows 4/12 -> 12/12",
    },
    {
        "parameter": "PatrickStar chunk budget (80% of each memory; a tenth of the GPU share in warm-up)",
        "value": "0.8, 0.1 (read from PatrickStar v0.4.3's memtracer, not fitted)",
        "fitted_on": "added after PatrickStar's capacity figures were seen (its rows +34%..+110% before)",
    },
]


def _loopback_rank(sizes: list[int], reps: int) -> dict:
    import torch.distributed as dist

    out = {}
    for n in sizes:
        x = torch.ones(n // 4)
        dist.all_reduce(x)
        best = float("inf")
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            best = min(best, time.perf_counter() - t)
        out[n] = best
    return out


def measure_loopback(reps: int = 5) -> Link:
    """A two-rank gloo all-reduce on 127.0.0.1, timed at 4 KiB and 32 MiB: bandwidth from
    the large one (an all-reduce of b bytes on 2 ranks puts b on the wire), latency from the
    small one (two hops)."""
    small, large = 4096, 32 * 2**20
    times = spawn(_loopback_rank, 2, [small, large], reps, timeout_s=300)[0]
    latency = times[small] / 2
    bandwidth = large / max(times[large] - 2 * latency, 1e-9)
    return Link(name="loopback", bandwidth=bandwidth, latency=latency, source="measured: gloo on 127.0.0.1")


def measure_cpu(threads: int = 1) -> DeviceProfile:
    """This CPU per rank: fp32 matmul peak on ``threads`` threads, and the bandwidth of a
    256 MiB copy (read + write)."""
    flops = matmul_peak_flops(threads=threads, n=1024, reps=10)
    a = torch.empty(64 * 2**20)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return DeviceProfile(
        name="this-cpu",
        fp32_flops=flops,
        bf16_flops=flops,
        memory_bandwidth=2 * a.numel() * 4 / best,
        memory_bytes=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
        source=f"measured here, {threads} thread(s)",
    )


def _dit_checks(dit: dict, hw: Hardware) -> list[dict]:
    out = []
    steps = dit["plan"]["steps"]
    for size in dit["plan"]["sizes"]:
        rows = {r["method"]: r["seconds"] for r in dit["rows"] if r["size"] == f"{size}x{size}"}
        spec = PRESETS["bench-dit"].with_tokens((size // 2) ** 2)
        table = [(LAYOUTS[m], rows[m]) for m in LAYOUTS if m in rows]
        out.append(
            {"table": f"bench dit {size}x{size}, loopback, {steps} steps"}
            | check_generate_rows(spec, hw, table, steps=steps, guidance=True)
        )
    scale = dit["link_scaling"]["scale"]
    spec = PRESETS["bench-dit"].with_tokens(dit["model"]["image_size"] ** 2 // 4)
    for name in dit["plan"]["links"]:
        rows = {r["method"]: r["seconds"] for r in dit["link_rows"] if r["link"] == name}
        table = [(LAYOUTS[m], rows[m]) for m in LAYOUTS if m in rows]
        linked = Hardware(
            device=hw.device, link=link_named(name).scaled(scale), precision="fp32", devices_per_node=2
        )
        out.append(
            {
                "table": f"bench dit 64x64, emulated {name} scaled x{scale:.3g}, {dit['plan']['link_steps']} steps",
                "kind": EMULATED,
            }
            | check_generate_rows(spec, linked, table, steps=dit["plan"]["link_steps"], guidance=True)
        )
    return out


def _train_check(train: dict, hw: Hardware) -> dict:
    rows = {r["variant"]: r for r in train["rows"]}
    cfg = train["config"]
    batch, seq = cfg["global_batch"], cfg["seq"]
    spec = gpt2_spec("gpt2", cfg["n_layer"], cfg["n_embd"], cfg["n_head"], tokens=seq, positions=seq)
    # DDP calibrates (torch's DDP, the same arithmetic and all-reduce volume as ZeRO-0)
    order = [("ddp", 0), ("tessera_zero1", 1), ("tessera_zero2", 2), ("tessera_zero3", 3)]

    def seconds(h: Hardware, zero: int) -> float:
        return predict_train(spec, Plan(dp=2, zero=zero), h, global_batch=batch, seq=seq).seconds

    def measured(variant: str) -> float:
        return batch * seq / rows[variant]["tokens_per_s"]

    hw = calibrate(lambda h: seconds(h, 0), hw, measured("ddp"))
    out = []
    for variant, zero in order:
        pred = predict_train(spec, Plan(dp=2, zero=zero), hw, global_batch=batch, seq=seq)
        row = rows[variant]
        out.append(
            {
                "layout": f"dp=2 zero={zero} ({variant})",
                "ranks": 2,
                "measured_s": round(measured(variant), 4),
                "predicted_s": round(pred.seconds, 4),
                "state_mib_predicted": round(sum(pred.state.values()) / 2**20, 1),
                "state_mib_measured": row["model_state_mib_per_rank"],
            }
        )
    return {
        "table": "bench train GPT-2 small, 2 ranks, loopback",
        "efficiency": round(hw.efficiency, 4),
    } | compare(out)


def run_plan_bench(results_dir: str | Path = RESULTS, quick: bool = False) -> BenchResult:
    results_dir = Path(results_dir)
    cpu = measure_cpu()
    loopback = measure_loopback(reps=2 if quick else 5)
    hw = Hardware(device=cpu, link=loopback, precision="fp32", devices_per_node=2)
    saved = save_profile(cpu)  # `tessera plan ... --device-profile this-cpu` plans for this machine
    checks: list[dict] = []
    notes = [
        f"this CPU: {cpu.fp32_flops / 1e9:.1f} GFLOP/s fp32 matmul per thread, {cpu.memory_bandwidth / 1e9:.1f} GB/s copy",
        f"loopback (2 gloo ranks): {loopback.bandwidth / 1e9:.2f} GB/s, {loopback.latency * 1e6:.0f} us per hop",
        "each table calibrates one number, the achieved fraction of peak (efficiency), on its first row; "
        "every other row is predicted; errors and Kendall's tau are over the predicted rows",
        f"this CPU's profile saved to {saved} (--device-profile this-cpu)",
    ]
    for name, build in (
        ("dit.json", lambda d: _dit_checks(d, hw)),
        ("train.json", lambda d: [_train_check(d, hw)]),
    ):
        path = results_dir / name
        if path.is_file():
            checks += [{"kind": THIS_MACHINE} | c for c in build(json.loads(path.read_text()))]
        else:
            notes.append(f"{path} absent: run its benchmark first; its check is skipped")
    fit_table = TABLES[0]  # xDiT FLUX PyTorch: the table the host seconds per op are fitted on
    host_op = fit_host_op_seconds(fit_table)
    notes.append(
        f"host seconds per eager op fitted on '{fit_table.name}' alone: {host_op * 1e6:.1f} us; "
        "every other published table is predicted with it (torch.compile tables: no host floor)"
    )
    checks += [check_published(t, host_op) | {"kind": FIT if t is fit_table else IN_SAMPLE} for t in TABLES]
    oos = out_of_sample.evaluate(host_op)
    oos_path = out_of_sample.write(oos, results_dir)
    notes.append(
        f"out of sample (model frozen at {oos['frozen']['frozen_at'][:7]}, {oos_path}): "
        f"{oos['headline']['new_rows_within_20pct']} new rows within 20%, best plan per GPU count "
        f"{oos['headline']['best_plan_per_gpu_count']}, ConsisID Spearman {oos['headline']['consisid_spearman']}"
    )
    scale = scale_checks()
    scale_headline, scale_md = scale_tables(scale)
    rows = [
        {"table": c["table"], "kind": c["kind"]} | r | {"efficiency": c["efficiency"]}
        for c in checks
        for r in c["rows"]
    ]
    summary = [
        {
            k: c[k]
            for k in (
                "table",
                "kind",
                "efficiency",
                "predicted",
                "within_20pct",
                "median_abs_error",
                "max_abs_error",
                "kendall_tau",
                "best_measured",
                "best_predicted",
                "flops_only_within_20pct",
                "flops_only_median_abs_error",
                "flops_only_kendall_tau",
            )
            if k in c
        }
        for c in checks
    ]

    def share(kind: str) -> str:
        chosen = [c for c in checks if c["kind"] == kind]
        return f"{sum(c['within_20pct'] for c in chosen)}/{sum(c['predicted'] for c in chosen)}"

    published = [c for c in checks if c["kind"].startswith("published")]
    fitted = (
        [{"parameter": "host seconds per eager op", "value": round(host_op * 1e6, 2), "unit": "us", "fitted_on": fit_table.name}]
        + [
            {"parameter": "efficiency (fraction of peak)", "value": c["efficiency"], "unit": "", "fitted_on": c["table"]}
            for c in checks
        ]
        + [
            {"parameter": "efficiency (fraction of peak)", "value": t["efficiency"], "unit": "", "fitted_on": t["table"]}
            for t in oos["tables"]
        ]
        + [
            {"parameter": "efficiency (fraction of peak)", "value": r["efficiency"], "unit": "", "fitted_on": r["series"]}
            for r in scale["throughput"]
            if r.get("calibration")
        ]
        + [
            {"parameter": "efficiency (fraction of peak)", "value": scale["colossal_bench"][0]["efficiency"], "unit": "",
             "fitted_on": "Colossal-AI README benchmark, H200 llama-7b zero2 dp8 row"}
        ]
        + [{"unit": ""} | t for t in TERMS_ADDED_AFTER_SEEING]
    )  # fmt: skip
    headline = {
        "this_machine_rows_within_20pct": share(THIS_MACHINE),
        "emulated_link_rows_within_20pct": share(EMULATED),
        "published_rows_within_20pct": f"{sum(c['within_20pct'] for c in published)}/{sum(c['predicted'] for c in published)}",
        "published_rows_within_20pct_in_sample": share(IN_SAMPLE),
        "published_fit_table_within_20pct": share(FIT),
        "out_of_sample": oos["headline"] | {"frozen_at": oos["frozen"]["frozen_at"]},
        "fitted_parameters": len(fitted),
        "published_rows_within_20pct_flops_only": f"{sum(c['flops_only_within_20pct'] for c in published)}/{sum(c['predicted'] for c in published)}",
        "host_op_us": round(host_op * 1e6, 2),
        "kendall_tau": {c["table"]: c["kendall_tau"] for c in checks},
        "best_choice_matches_this_machine": (
            f"{sum(c['best_measured'] == c['best_predicted'] for c in checks if c['kind'] == THIS_MACHINE)}"
            f"/{sum(c['kind'] == THIS_MACHINE for c in checks)}"
        ),
        "best_choice_matches": f"{sum(c['best_measured'] == c['best_predicted'] for c in checks)}/{len(checks)}",
    } | scale_headline
    return BenchResult(
        name="plan",
        headline=headline,
        rows=rows,
        columns=[
            "table",
            "layout",
            "ranks",
            "measured_s",
            "predicted_s",
            "rel_error",
            "efficiency",
            "predicted_s_flops_only",
        ],
        notes=notes,
        extra={
            "summary": summary,
            "cpu": vars(cpu),
            "loopback": vars(loopback),
            "scale": scale,
            "fitted_parameters": fitted,
            "out_of_sample": oos,
        },
        tables=[
            ("Per table", list(dict.fromkeys(k for row in summary for k in row)), summary),
            *scale_md,
            ("Fitted parameters", ["parameter", "value", "unit", "fitted_on"], fitted),
        ],
    )


def plot_plan(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    for kind, marker in ((THIS_MACHINE, "o"), (EMULATED, "x"), (IN_SAMPLE, "s"), (FIT, "^")):
        rows = [r for r in result.rows if r["kind"] == kind]
        ax.scatter(
            [r["measured_s"] for r in rows],
            [r["predicted_s"] for r in rows],
            marker=marker,
            label=kind,
            alpha=0.7,
        )
    values = [v for r in result.rows for v in (r["measured_s"], r["predicted_s"])]
    lo, hi = min(values) * 0.8, max(values) * 1.25
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="exact")
    ax.fill_between(
        [lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="grey", alpha=0.15, label="within 20%"
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="measured seconds",
        ylabel="predicted seconds",
        title="tessera plan: predicted vs measured",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
