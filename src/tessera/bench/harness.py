"""The shared part of every `tessera bench NAME`: machine facts, timing, memory, and
writing NAME.json (headline + machine + rows), NAME.md (a table) and NAME.png."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.kernels.machine import cpu_description

DEFAULT_OUT = Path("benchmarks/results")


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_description(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def matmul_peak_flops(threads: int = 1, n: int = 512, reps: int = 20) -> float:
    """This machine's fp32 matmul FLOP/s on ``threads`` threads (best of ``reps``)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    torch.set_num_threads(old)
    return 2 * n**3 / best


@dataclass
class BenchResult:
    name: str
    headline: dict[str, Any]
    rows: list[dict[str, Any]]
    columns: list[str]  # which row keys the markdown table shows, in order
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # more markdown tables after the main one: (title, columns, rows); their rows belong in extra
    tables: list[tuple[str, list[str], list[dict[str, Any]]]] = field(default_factory=list)


def write_results(
    result: BenchResult, out_dir: str | Path, plot: Callable[[BenchResult, Path], None]
) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "name": result.name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "headline": result.headline,
        "machine": machine(),
        "notes": result.notes,
        **result.extra,
        "rows": result.rows,
    }
    paths = [out_dir / f"{result.name}.json", out_dir / f"{result.name}.md", out_dir / f"{result.name}.png"]
    _atomic_write(paths[0], json.dumps(payload, indent=2) + "\n")
    _atomic_write(paths[1], markdown(result, payload["machine"]))
    partial = paths[2].with_name(f".{paths[2].name}.partial.png")
    plot(result, partial)
    os.replace(partial, paths[2])
    return paths


def _atomic_write(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(columns: list[str], rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]


def markdown(result: BenchResult, machine_info: dict[str, Any]) -> str:
    lines = [f"# {result.name}", ""]
    lines.append(
        "Machine: "
        + ", ".join(f"{k} {v}" for k, v in machine_info.items() if k in ("cpu", "cores", "torch", "device"))
    )
    lines += ["", "Headline: " + ", ".join(f"`{k}` = {_cell(v)}" for k, v in result.headline.items()), ""]
    lines += _table(result.columns, result.rows)
    for title, columns, rows in result.tables:
        lines += ["", f"## {title}", "", *_table(columns, rows)]
    if result.notes:
        lines += ["", *[f"- {n}" for n in result.notes]]
    return "\n".join(lines) + "\n"
