"""The planner's memory and step models against PatrickStar's and Colossal-AI's published
scale figures (tessera.plan.published_scale): the largest model that fits, throughput, and
the order of the systems.

Largest model: a row is ``within`` when the published size fits and the next size of the
source's ladder does not (the prediction brackets the published maximum), ``over`` when the
next size is predicted to fit too, ``under`` when the published size is predicted not to
fit; ``rel_error`` is the predicted capacity (parameters of the published model's shape that
fit) over the published size, minus 1. Throughput: each series calibrates one number, the
GPU efficiency, on its first point; the other points are predictions.
"""

from __future__ import annotations

import dataclasses

from scipy.stats import kendalltau

from tessera.plan.devices import device_named
from tessera.plan.hardware import Hardware
from tessera.plan.hetero import Node, calibrate_efficiency, capacity_params, fits, placement, tflops_total
from tessera.plan.model_spec import gpt2_spec
from tessera.plan.published_scale import (
    CAI_BENCH,
    CAI_BENCH_ROWS,
    GB,
    GIB,
    LLAMA,
    CapacityRow,
    capacity_rows,
    throughput_series,
)
from tessera.plan.training import predict_train
from tessera.plan.training_plan import Plan
from tessera.runtime.link import Link, link_named

CAPACITY_BATCH, THROUGHPUT_BATCH, SEQ = 4, 8, 1024
# Inter-node link of the 16-GPU H200 row: not stated; one NDR 400 Gb/s port per GPU
# (50 GB/s, ConnectX-7) at ~90% is assumed.
IB_NDR = Link(name="ib-ndr", bandwidth=45 * GB, latency=2e-6, source="assumed: ConnectX-7 NDR 400 Gb/s, ~90%")


def _node(row: CapacityRow) -> Node:
    return dataclasses.replace(row.node, gpus=row.gpus)


def _shape(row: CapacityRow):
    """The published model's shape: its ladder entry, or (no ladder: Colossal-AI's figures do
    not give the configs) a GPT-2 of GPT-2 small's width (768) below 0.5B and GPT-2 XL's
    (1600) above, as deep as the published size needs."""
    if row.ladder and row.published in row.ladder:
        return row.ladder[row.published]
    hidden, heads = (768, 12) if row.published < 0.5 else (1600, 25)
    layers = max(1, round(row.published * 1e9 / (12 * hidden**2)))
    return gpt2_spec(f"gpt2-{row.published}B", layers, hidden, heads)


def capacity_check(row: CapacityRow) -> dict:
    spec, node = _shape(row), _node(row)
    batch = row.batch
    out = {
        "group": row.group, "system": row.label, "model": row.system, "gpus": row.gpus,
        "published_b": row.published, "next_b": row.next_size, "source": row.source, "note": row.note,
    }  # fmt: skip
    if not row.predictable:
        gpu = placement(spec, row.system, batch, SEQ, dataclasses.replace(node, cpu_bytes=1e18))["gpu"]
        total = {"chunk": 14, "zero-offload": 18}[row.system] * spec.total_params
        out["implied_host_gb"] = round(max(0.0, total - gpu) / GB, 1)
        return out | {"verdict": "not predictable (host memory not stated)"}
    capacity = capacity_params(spec, row.system, batch, SEQ, node) / 1e9
    ok = fits(spec, row.system, batch, SEQ, node)
    nxt = row.ladder.get(int(row.next_size)) if row.next_size and row.ladder else None
    over = nxt is not None and fits(nxt, row.system, batch, SEQ, node)
    verdict = (
        "under" if not ok else "over" if over else "within" if nxt is not None else "fits (no next size)"
    )
    return out | {
        "published_params_b": round(spec.total_params / 1e9, 2),
        "predicted_capacity_b": round(capacity, 2),
        "rel_error": round(capacity * 1e9 / spec.total_params - 1, 4),
        "verdict": verdict,
    }


def _order(rows: list[dict], key: str) -> str:
    return " > ".join(r["system"] for r in sorted(rows, key=lambda r: -r[key]))


def _ranking(rows: list[dict]) -> list[dict]:
    """Per group and GPU count with two or more systems: Kendall's tau between the
    predicted capacities and the published sizes (ties in the published count as ties)."""
    out = []
    keys = sorted({(r["group"], r["gpus"]) for r in rows if "predicted_capacity_b" in r})
    for group, gpus in keys:
        same = [r for r in rows if r["group"] == group and r["gpus"] == gpus and "predicted_capacity_b" in r]
        if len({r["model"] for r in same}) < 2:
            continue
        tau = kendalltau(
            [r["predicted_capacity_b"] for r in same], [r["published_b"] for r in same]
        ).statistic
        out.append({
            "group": group, "gpus": gpus, "published_order": _order(same, "published_b"),
            "predicted_order": _order(same, "predicted_capacity_b"), "kendall_tau": round(float(tau), 3),
        })  # fmt: skip
    return out


def throughput_checks() -> list[dict]:
    out = []
    for series in throughput_series():
        node = dataclasses.replace(series.node, gpus=series.gpus)
        first_size, first_tflops = series.points[0]
        eff = calibrate_efficiency(
            series.ladder[first_size], series.system, THROUGHPUT_BATCH, SEQ, node, first_tflops
        )
        for size, published in series.points:
            pred = tflops_total(series.ladder[size], series.system, THROUGHPUT_BATCH, SEQ, node, eff)
            out.append({
                "series": series.name, "model_b": size, "published_tflops": published,
                "predicted_tflops": round(pred, 1), "rel_error": round(pred / published - 1, 4),
                "efficiency": round(eff, 4), "calibration": size == first_size, "note": series.note,
            })  # fmt: skip
    return out


def system_order_checks(throughput: list[dict]) -> list[dict]:
    """A100: PatrickStar vs DeepSpeed at each GPU count and size both published, both
    predicted at PatrickStar's calibrated efficiency (so the order comes from the memory and
    transfer model, not from a fitted number)."""
    out = []
    series = {s.name: s for s in throughput_series()}
    for gpus in (1, 2, 4, 8):
        ps, ds = series[f"PatrickStar A100 pstar-{gpus}-gpu"], series[f"PatrickStar A100 deeps-{gpus}-gpu"]
        node = dataclasses.replace(ps.node, gpus=gpus)
        eff = next(r["efficiency"] for r in throughput if r["series"] == ps.name)
        for (size, p_pub), (_, d_pub) in zip(ps.points, ds.points, strict=False):
            spec = ps.ladder[size]
            p = tflops_total(spec, "chunk", THROUGHPUT_BATCH, SEQ, node, eff)
            d = tflops_total(spec, "zero-offload", THROUGHPUT_BATCH, SEQ, node, eff)
            out.append({
                "gpus": gpus, "model_b": size, "published_ratio": round(p_pub / d_pub, 3),
                "predicted_ratio": round(p / d, 3), "same_order": (p > d) == (p_pub > d_pub),
            })  # fmt: skip
    return out


def colossal_3080_checks() -> list[dict]:
    """GPT2-NVME.png's throughput bars (no units): Colossal-AI ÷ DeepSpeed at 1.5B and 4B on
    one RTX 3080 10GB (PCIe 4; GA102 whitepaper: 59.5 TFLOP/s fp16 with fp32 accumulate).
    Assumed (not stated): host memory unbounded, dual-channel DDR4-3200 at ~70% = 36 GB/s,
    efficiency 0.4 (tessera plan's default), batch 4."""
    node = Node(
        gpus=1, gpu_bytes=10 * GIB, cpu_bytes=1e18, gpu_flops=59.5e12, gpu_bandwidth=760 * GB,
        pcie_bandwidth=25 * GB, cpu_bandwidth=36 * GB,
    )  # fmt: skip
    out = []
    for size, ds_pub, cai_pub in ((1.5, 0.227, 0.297), (4.0, 0.083, 0.105)):
        spec = gpt2_spec(f"gpt2-{size}B", max(1, round(size * 1e9 / (12 * 1600**2))), 1600, 25)
        cai = tflops_total(spec, "chunk", CAPACITY_BATCH, SEQ, node, 0.4)
        ds = tflops_total(spec, "zero-offload", CAPACITY_BATCH, SEQ, node, 0.4)
        out.append({
            "model_b": size, "published_ratio": round(cai_pub / ds_pub, 3), "predicted_ratio": round(cai / ds, 3),
            "rel_error": round((cai / ds) / (cai_pub / ds_pub) - 1, 4), "source": "hpcaitech/public_assets colossalai/img/GPT2-NVME.png",
        })  # fmt: skip
    return out


def colossal_bench_checks() -> list[dict]:
    """The README's H200 rows: calibrate on the 7B row, predict the 70B row's samples/s."""
    rows = [r for r in CAI_BENCH_ROWS if r[7]]

    def predict(h: Hardware, row) -> float:
        _, gpus, model, _, batch, *_ = row
        c = Plan(dp=gpus, zero=2, activation_checkpointing=True)
        pred = predict_train(LLAMA[model], c, h, global_batch=batch * gpus, seq=4096)
        return batch * gpus / pred.seconds

    hw = Hardware(device=device_named("h200"), link=link_named("nvlink4"), inter_node=IB_NDR, precision="bf16")
    from tessera.plan.check import calibrate

    hw = calibrate(
        lambda h: rows[0][4] * rows[0][1] / predict(h, rows[0]), hw, rows[0][4] * rows[0][1] / rows[0][5]
    )
    out = []
    for row in CAI_BENCH_ROWS:
        gpu, gpus, model, plan, batch, samples, tflops, ok = row
        pred = predict(hw, row) if ok else None
        out.append({
            "gpu": gpu, "gpus": gpus, "model": model, "plan": plan, "batch_per_dp": batch,
            "published_samples_s": samples, "published_tflops_gpu": tflops,
            "predicted_samples_s": round(pred, 3) if pred else None,
            "rel_error": round(pred / samples - 1, 4) if pred else None,
            "efficiency": round(hw.efficiency, 4), "source": CAI_BENCH,
            "note": "" if ok else "tp x pp x zero plan: not simulated",
        })  # fmt: skip
    return out


def scale_checks() -> dict:
    capacity = [capacity_check(r) for r in capacity_rows()]
    throughput = throughput_checks()
    return {
        "capacity": capacity,
        "capacity_ranking": _ranking(capacity),
        "throughput": throughput,
        "system_order": system_order_checks(throughput),
        "colossal_3080": colossal_3080_checks(),
        "colossal_bench": colossal_bench_checks(),
    }


def _share(rows: list[dict], key: str = "rel_error", limit: float = 0.2) -> str:
    scored = [r for r in rows if r.get(key) is not None and not r.get("calibration")]
    return f"{sum(abs(r[key]) <= limit for r in scored)}/{len(scored)}"


def scale_tables(checks: dict) -> tuple[dict, list[tuple[str, list[str], list[dict]]]]:
    """The headline figures and the markdown tables of ``scale_checks()``."""
    cap = checks["capacity"]
    predicted = [
        r for r in cap if "verdict" in r and r["verdict"] != "not predictable (host memory not stated)"
    ]
    headline = {
        "scale_capacity_rows_predicted": f"{len(predicted)}/{len(cap)}",
        "scale_capacity_within_20pct": _share(predicted),
        "scale_capacity_verdicts": {v: sum(r["verdict"] == v for r in predicted) for v in sorted({r["verdict"] for r in predicted})},
        "scale_capacity_order_matches": f"{sum(r['kendall_tau'] == 1.0 for r in checks['capacity_ranking'])}/{len(checks['capacity_ranking'])}",
        "scale_throughput_within_20pct": _share(checks["throughput"]),
        "scale_pstar_vs_deepspeed_order": f"{sum(r['same_order'] for r in checks['system_order'])}/{len(checks['system_order'])}",
        "scale_colossal_3080_ratio_within_20pct": _share(checks["colossal_3080"]),
        "scale_colossal_bench_within_20pct": _share([r for r in checks["colossal_bench"] if r["rel_error"] != 0.0]),
    }  # fmt: skip
    cap_cols = ["group", "system", "gpus", "published_b", "next_b", "published_params_b", "predicted_capacity_b",
                "rel_error", "verdict", "implied_host_gb", "note"]  # fmt: skip
    tables = [
        ("Published scale: the largest model that fits (PatrickStar, Colossal-AI)", cap_cols, cap),
        ("Published scale: systems ordered by the largest model", list(checks["capacity_ranking"][0]), checks["capacity_ranking"]),
        ("Published scale: PatrickStar throughput (each series calibrated on its first point)",
         ["series", "model_b", "published_tflops", "predicted_tflops", "rel_error", "efficiency", "note"], checks["throughput"]),
        ("Published scale: PatrickStar / DeepSpeed TFLOP/s on the A100 node, both at PatrickStar's efficiency",
         list(checks["system_order"][0]), checks["system_order"]),
        ("Published scale: Colossal-AI / DeepSpeed throughput on one RTX 3080", list(checks["colossal_3080"][0]), checks["colossal_3080"]),
        ("Published scale: Colossal-AI benchmark table (calibrated on its first row)", list(checks["colossal_bench"][0]), checks["colossal_bench"]),
    ]  # fmt: skip
    return headline, tables
