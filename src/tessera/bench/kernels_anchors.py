"""The anchors of `tessera bench kernels`, each at its best and each with the code path it ran:
OpenBLAS, BLIS and AMD's AOCL-BLAS (GEMM; loaded once, thread count set once per timing loop), torch's MKL,
MKL-packed and oneDNN GEMM and its default, oneDNN and oneDNN-packed convolutions (the best
torch path per shape is torch's anchor), TVM MetaSchedule on a few shapes, numpy as a sanity
row (never an anchor). A library that cannot run is recorded absent with the reason."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from tessera.kernels import anchors, blas_libs
from tessera.kernels.anchor_paths import describe, torch_code_paths
from tessera.kernels.anchors import AnchorAbsent

GIGA = 1e9
BLAS = ("openblas", "blis", "aocl_blis")
# after a multi-threaded timing loop, long enough for the library's idle workers to stop
# spinning (LLVM's OpenMP spins 200 ms by default, OpenBLAS's threads about 0.1 s) before the
# next library runs on the same cores
SETTLE_S = 0.25
# every anchor a row's best is taken over (numpy is a sanity row, not an anchor)
ANCHORS = (*BLAS, "torch", "tvm")


class AnchorSet:
    """The anchor libraries of one run: loaded once, absent ones with their reason."""

    def __init__(self, kernel_set: str = "widest"):
        self.blas: dict[str, blas_libs.BlasLibrary] = {}
        self.absent: dict[str, str] = {}
        for name in BLAS:
            try:
                self.blas[name] = blas_libs.load(name, kernel_set)
            except AnchorAbsent as exc:
                self.absent[name] = str(exc)

    def runners(self, kind: str, spec, threads: int) -> dict[str, anchors.Runner]:
        """name -> Runner for one case; a path that cannot run is noted in ``absent``."""
        makers = {}
        if kind == "gemm":
            makers |= {
                name: (lambda lib=lib: anchors.blas_gemm(lib, *spec, threads))
                for name, lib in self.blas.items()
            }
            makers |= {
                f"torch_{p}": (lambda p=p: anchors.torch_gemm(*spec, threads, p))
                for p in anchors.TORCH_GEMM_PATHS
            }
            makers["numpy"] = lambda: anchors.numpy_gemm(*spec, threads)
        else:
            makers |= {
                f"torch_{p}": (lambda p=p: anchors.torch_conv(spec, threads, p))
                for p in anchors.TORCH_CONV_PATHS
            }
            makers["numpy"] = lambda: anchors.numpy_conv(spec, threads)
        out = {}
        for name, make in makers.items():
            try:
                out[name] = make()
            except AnchorAbsent as exc:
                self.absent.setdefault(
                    f"{name} ({kind}, {threads} thread{'s' if threads > 1 else ''})", str(exc)
                )
        return out

    def measure(
        self,
        kind: str,
        spec,
        threads: int,
        flops: float,
        median_seconds,
        repeats: int,
        settle_s: float = SETTLE_S,
    ) -> dict:
        """Every anchor's GFLOP/s for one case (threads set once around each timing loop)."""
        row = {}
        for name, runner in self.runners(kind, spec, threads).items():
            with runner.threads():
                row[f"{name}_gflops"] = round(flops / median_seconds(runner.call, repeats) / GIGA, 2)
            if threads > 1:
                time.sleep(settle_s)
        torch_paths = {
            k.removeprefix("torch_").removesuffix("_gflops"): v
            for k, v in row.items()
            if k.startswith("torch_")
        }
        if torch_paths:
            row["torch_path"] = max(torch_paths, key=torch_paths.get)
            row["torch_gflops"] = torch_paths[row["torch_path"]]
        return row

    def library_paths(self) -> dict[str, dict]:
        """What each BLAS library reports of itself, and threadpoolctl's view of it."""
        from threadpoolctl import threadpool_info

        info = {i["filepath"]: i for i in threadpool_info()}
        out = {}
        for name, lib in self.blas.items():
            seen = next((v for k, v in info.items() if k.endswith(lib.path.rsplit("/", 1)[-1])), None)
            out[name] = {**lib.code_path, "threadpoolctl": seen}
        return out

    @staticmethod
    def numpy_path() -> str:
        """numpy's own BLAS as threadpoolctl sees it (the sanity row's code path)."""
        import numpy as np
        from threadpoolctl import threadpool_info

        root = str(Path(np.__file__).parent.parent)
        mine = [
            i
            for i in threadpool_info()
            if i["user_api"] == "blas" and i["filepath"].startswith(root) and ("numpy" in i["filepath"])
        ]
        return _tpc(mine[0]) if mine else "numpy's BLAS not seen by threadpoolctl"


def torch_requests(rows: list[dict], specs: dict) -> list[dict]:
    """One code-path request per (row, torch path) measured in it."""
    reqs = []
    for i, row in enumerate(rows):
        kind, spec = row["kind"], specs[i]
        paths = anchors.TORCH_GEMM_PATHS if kind == "gemm" else anchors.TORCH_CONV_PATHS
        for p in paths:
            if f"torch_{p}_gflops" in row:
                reqs.append(
                    {
                        "row": i,
                        "kind": kind,
                        "path": p,
                        "threads": row["threads"],
                        "spec": list(spec) if kind == "gemm" else asdict(spec),
                    }
                )
    return reqs


def attach_code_paths(rows: list[dict], specs: dict, anchor_set: AnchorSet) -> dict:
    """Each row's ``paths`` (anchor -> the code it ran), its best anchor and the path of that;
    returns the run-wide report (library banners and self-reports)."""
    reqs = torch_requests(rows, specs)
    report = torch_code_paths([{k: v for k, v in r.items() if k != "row"} for r in reqs])
    per_request = report.pop("requests", [{} for _ in reqs])
    for req, got in zip(reqs, per_request, strict=True):
        rows[req["row"]].setdefault("paths", {})[f"torch_{req['path']}"] = describe(got) if got else "unknown"
    libs, numpy_path = anchor_set.library_paths(), anchor_set.numpy_path()
    for row in rows:
        paths = row.setdefault("paths", {})
        for name, rep in libs.items():
            if f"{name}_gflops" in row:
                paths[name] = rep.get("corename") or rep.get("arch")
        if "torch_path" in row:
            paths["torch"] = paths.get(f"torch_{row['torch_path']}", "unknown")
        if "numpy_gflops" in row:
            paths["numpy"] = numpy_path
        if "tvm_gflops" in row:
            paths["tvm"] = row.get("tvm_code_path", "TVM")
    return {"libraries": libs, "torch": report, "numpy": numpy_path}


def median_of_rounds(rounds: list[dict]) -> dict:
    """One case's timing rounds (each Tessera's and every anchor's GFLOP/s) as one row: each
    figure the median over rounds, torch's path the best of its paths' medians, the rounds kept."""
    keys = [k for k in rounds[0] if (k.endswith("gflops") and k != "torch_gflops") or k == "seconds"]
    row = {k: statistics.median(r[k] for r in rounds) for k in keys}
    torch_paths = {
        k.removeprefix("torch_").removesuffix("_gflops"): v for k, v in row.items() if k.startswith("torch_")
    }
    if torch_paths:
        row["torch_path"] = max(torch_paths, key=torch_paths.get)
        row["torch_gflops"] = torch_paths[row["torch_path"]]
    kept = [k for k in keys if k != "seconds"] + (["torch_gflops"] if torch_paths else [])
    row["rounds"] = [{k: r[k] for k in kept} for r in rounds]
    return row


def round_rows(rows: list[dict], i: int) -> list[dict]:
    """The rows as timing round ``i`` measured them (torch's anchor: its best path in that round)."""
    out = []
    for row in rows:
        mine = {**row, **row["rounds"][i]}
        best_anchor(mine)
        out.append(mine)
    return out


def rounds_headline(rows: list[dict]) -> dict:
    """Each timing round's win fraction and geomean over the best anchor, with their range."""
    n = min((len(r.get("rounds", ())) for r in rows), default=0)
    if n == 0:
        return {}
    per = [anchor_headline(round_rows(rows, i), {}, {}) for i in range(n)]
    wins = [p["win_fraction_vs_best_anchor"] for p in per]
    geo = [p["geomean_vs_best_anchor"] for p in per]
    return {
        "timing_rounds": n,
        "win_fraction_rounds": wins,
        "win_fraction_range": [min(wins), max(wins)],
        "geomean_rounds": geo,
        "geomean_range": [min(geo), max(geo)],
    }


def best_anchor(row: dict) -> None:
    """The row's best anchor (over ANCHORS present) and Tessera's ratio to it."""
    present = {a: row[f"{a}_gflops"] for a in ANCHORS if row.get(f"{a}_gflops")}
    if not present:
        row["best_anchor"], row["vs_best_anchor"], row["win"] = None, None, None
        return
    name = max(present, key=present.get)
    row["best_anchor"], row["best_anchor_gflops"] = name, present[name]
    row["best_anchor_path"] = row.get("paths", {}).get(name, "")
    row["vs_best_anchor"] = round(row["gflops"] / present[name], 3)
    row["win"] = row["gflops"] >= 0.95 * present[name]


def anchor_headline(rows: list[dict], absent: dict[str, str], report: dict) -> dict:
    scored = [r for r in rows if r.get("vs_best_anchor")]
    ratios = [r["vs_best_anchor"] for r in scored]
    h = {
        "win_fraction_vs_best_anchor": round(sum(r["win"] for r in scored) / len(scored), 3)
        if scored
        else None,
        "geomean_vs_best_anchor": round(math.exp(statistics.fmean(math.log(x) for x in ratios)), 3)
        if ratios
        else None,
        "best_anchor_counts": {
            a: sum(r["best_anchor"] == a for r in scored)
            for a in ANCHORS
            if any(r["best_anchor"] == a for r in scored)
        },
        "numpy_rows_above_best_anchor": sum(
            r.get("numpy_gflops", 0) > r.get("best_anchor_gflops", math.inf) for r in scored
        ),
        "anchors_absent": absent or None,
    }
    libs, torch_report = report.get("libraries", {}), report.get("torch", {})
    h["anchor_code_paths"] = {
        **{name: rep.get("corename") or rep.get("arch") for name, rep in libs.items()},
        "torch_mkl": torch_report.get("mkl"),
        "torch_onednn_isa": torch_report.get("onednn_isa"),
        "torch_cpu_capability": torch_report.get("cpu_capability"),
        "numpy_sanity_row": report.get("numpy"),
        **({"torch_error": torch_report["error"]} if "error" in torch_report else {}),
    }
    return h


def code_path_table(report: dict) -> list[dict]:
    """One row per anchor library: what it is, what it detected alone and what it ran."""
    out = []
    for name, rep in report.get("libraries", {}).items():
        out.append(
            {
                "anchor": name,
                "library": f"{rep.get('library')} {rep.get('version', '')}".strip(),
                "detected_alone": rep.get("detected_alone")
                + (f" (this environment sets {_env(rep['environment'])})" if rep.get("environment") else ""),
                "forced": rep.get("forced") or "no",
                "ran": rep.get("corename") or rep.get("arch"),
                "threadpoolctl": _tpc(rep.get("threadpoolctl")),
            }
        )
    t = report.get("torch", {})
    if "error" in t:
        out.append({"anchor": "torch", "library": "torch", "ran": f"code paths not reported: {t['error']}"})
        return out
    per_row = "per row: the functions and primitives one call ran"
    out.append(
        {"anchor": "torch (MKL)", "library": t.get("mkl"), "forced": "no", "ran": f"{per_row} (MKL_VERBOSE)"}
    )
    out.append(
        {
            "anchor": "torch (oneDNN)",
            "library": f"oneDNN, ISA: {t.get('onednn_isa')}",
            "forced": "oneDNN called directly",
            "ran": f"{per_row} (ONEDNN_VERBOSE)",
        }
    )
    out.append(
        {"anchor": "numpy (sanity row)", "library": "numpy's bundled BLAS", "ran": report.get("numpy")}
    )
    out.append(
        {
            "anchor": "torch (ATen)",
            "library": "torch.backends.cpu.get_cpu_capability()",
            "ran": t.get("cpu_capability"),
        }
    )
    return out


def _env(env: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in env.items())


def _tpc(info: dict | None) -> str:
    if not info:
        return "not seen"
    return (
        f"{info.get('internal_api')} {info.get('version')} {info.get('architecture')} "
        f"{info.get('threading_layer')} {info.get('num_threads')} threads"
    )


def tvm_curve_rows(rows: list[dict]) -> list[dict]:
    """The speed-versus-trials table of every TVM-tuned shape."""
    out = []
    for r in rows:
        for point in r.get("tvm_curve", []):
            out.append(
                {
                    "shape": r["shape"],
                    "trials": point["trials"],
                    "tuning_s": point["tuning_s"],
                    "tvm_best_gflops": round(r["flops"] / point["best_s"] / GIGA, 2)
                    if point["best_s"]
                    else None,
                    "tessera_gflops": r["gflops"],
                }
            )
    return out


def tvm_match_time(row: dict) -> float | None:
    """Seconds of tuning after which TVM's best measured candidate was at least as fast as
    Tessera's kernel on the same shape (None: never within the budget)."""
    for point in row.get("tvm_curve", []):
        if point["best_s"] and row["flops"] / point["best_s"] / GIGA >= row["gflops"]:
            return point["tuning_s"]
    return None
