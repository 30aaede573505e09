"""Predictions against measurements: one table at a time, calibrated on its one-device row.

The only number fitted per table is the achieved fraction of the device's peak
(``efficiency``), from the table's serial row; every other row is a prediction of the
simulator. One number is fitted across tables: the host seconds per eager op
(``fit_host_op_seconds``), on xDiT's FLUX PyTorch table alone; the other published tables
are predicted with it, and reported apart from the table it was fitted on. Reported per row:
predicted and measured seconds, the relative error, and Kendall's tau between the predicted
and the measured order of the parallel rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from scipy.stats import kendalltau

from tessera.diffusion.layout import ParallelConfig
from tessera.plan.devices import device_named
from tessera.plan.hardware import Hardware
from tessera.plan.inference import predict_generate
from tessera.plan.model_spec import model_spec
from tessera.plan.published import PublishedTable
from tessera.runtime.link import link_named


def calibrate(predict: Callable[[Hardware], float], hw: Hardware, measured: float) -> Hardware:
    """``hw`` with the efficiency at which ``predict`` gives ``measured`` seconds (compute
    scales as 1 / efficiency; links do not, so iterate a few times). An efficiency above 1
    is reported as it is: the row needs more than the datasheet's peak for the FLOPs counted."""
    eff = 1.0
    for _ in range(30):
        trial = dataclasses.replace(hw, efficiency=eff)
        seconds = predict(trial)
        eff = trial.efficiency * seconds / measured
        if abs(seconds - measured) <= 1e-6 * measured:
            break
    return dataclasses.replace(hw, efficiency=eff)


def compare(rows: list[dict]) -> dict:
    """Errors and ranking over rows with ``predicted_s`` and ``measured_s``; the first row is
    the calibration row and is left out of both."""
    rest = rows[1:]
    for row in rows:
        row["rel_error"] = round(row["predicted_s"] / row["measured_s"] - 1, 4)
    errors = [abs(r["rel_error"]) for r in rest]
    tau = (
        kendalltau([r["predicted_s"] for r in rest], [r["measured_s"] for r in rest]).statistic
        if len(rest) > 1
        else None
    )
    return {
        "rows": rows,
        "max_abs_error": round(max(errors), 4) if errors else None,
        "median_abs_error": round(sorted(errors)[len(errors) // 2], 4) if errors else None,
        "within_20pct": sum(e <= 0.2 for e in errors),
        "predicted": len(rest),
        "kendall_tau": None if tau is None or tau != tau else round(float(tau), 3),
        "best_measured": min(rest, key=lambda r: r["measured_s"])["layout"] if rest else None,
        "best_predicted": min(rest, key=lambda r: r["predicted_s"])["layout"] if rest else None,
    }


def check_generate_rows(
    spec, hw: Hardware, rows: list[tuple[ParallelConfig, float]], *, steps: int, guidance: bool
) -> dict:
    serial, measured = rows[0]
    if serial.world_size != 1:
        raise ValueError(f"the first row calibrates and must be serial, got {serial.describe()}")
    hw = calibrate(
        lambda h: predict_generate(spec, serial, h, steps=steps, guidance=guidance).seconds, hw, measured
    )
    out = []
    for config, seconds in rows:
        predicted = predict_generate(spec, config, hw, steps=steps, guidance=guidance)
        out.append(
            {
                "layout": config.describe(),
                "ranks": config.world_size,
                "measured_s": seconds,
                "predicted_s": round(predicted.seconds, 4),
                "predicted_mem_gib_per_rank": round(predicted.memory_bytes_per_rank / 2**30, 2),
            }
        )
    return {"efficiency": round(hw.efficiency, 4)} | compare(out)


def check_published(table: PublishedTable, host_op_seconds: float = 0.0) -> dict:
    """One published table; beside each prediction, the FLOPs-and-bytes-only one (no host
    floor, no decode), so what those two terms change is shown row by row."""
    host = 0.0 if table.compiled else host_op_seconds
    hw = Hardware(device=device_named(table.device), link=link_named(table.link), precision="bf16")
    spec, rows = model_spec(table.model), list(table.rows)
    kw = dict(steps=table.steps, guidance=table.guidance)
    result = check_generate_rows(spec, dataclasses.replace(hw, host_op_seconds=host), rows, **kw)
    bare_spec = dataclasses.replace(spec, host_ops_per_layer=0.0, decode_flops=0.0)
    bare = check_generate_rows(bare_spec, hw, rows, **kw)
    for row, plain in zip(result["rows"], bare["rows"], strict=True):
        row["predicted_s_flops_only"] = plain["predicted_s"]
    return (
        {"table": table.name, "source": table.source, "note": table.note, "host_op_seconds": host}
        | result
        | {
            "flops_only_within_20pct": bare["within_20pct"],
            "flops_only_median_abs_error": bare["median_abs_error"],
            "flops_only_kendall_tau": bare["kendall_tau"],
        }
    )


def _log_error(table: PublishedTable, host_op_seconds: float) -> float:
    rows = check_published(table, host_op_seconds)["rows"][1:]
    return sum(abs(math.log(r["predicted_s"] / r["measured_s"])) for r in rows) / len(rows)


def fit_host_op_seconds(table: PublishedTable, hi: float = 60e-6, points: int = 25) -> float:
    """The host seconds per eager op that fit ``table`` best (mean |log error| of its
    predicted rows) on a grid of ``points`` over [0, hi] (2.5 us apart by default). Fitted on
    one table; every other table is predicted with it."""
    grid = [hi * i / (points - 1) for i in range(points)]
    return min(grid, key=lambda t: _log_error(table, t))
