"""What `tessera bench serve` measures of one running server: a load run by the load generator
(`tessera.serve.loadgen`, in a process of its own pinned to a core), its summary
(throughput, latency percentiles, goodput), a Tessera server's batch statistics from its
/metrics and /info, and how far a server's embeddings are from the model's."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from tessera.bench.serve_systems import bench_env, pin_to


def run_load(job: dict, core: int | None) -> list[list]:
    from tessera.serve import loadgen

    proc = subprocess.run([sys.executable, "-P", loadgen.__file__], input=json.dumps(job), capture_output=True,
                          text=True, env=bench_env(), preexec_fn=pin_to(core), check=True)  # fmt: skip
    return json.loads(proc.stdout)


def summarize(records: list[list], slo_s: float) -> dict:
    import numpy as np

    ok = [r for r in records if r[3] == 200]
    duration = max(r[2] for r in records) - min(r[1] for r in records)
    latency = np.array([r[2] - r[1] for r in ok]) if ok else np.array([float("nan")])
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "duration_s": duration,
        "throughput_rps": len(ok) / duration,
        "tokens_per_s": sum(r[4] for r in ok) / duration,
        "p50_s": float(np.percentile(latency, 50)),
        "p90_s": float(np.percentile(latency, 90)),
        "p99_s": float(np.percentile(latency, 99)),
        "goodput_rps": sum(1 for r in ok if r[2] - r[1] <= slo_s) / duration,
        # the slowest 1% (p99 and above): [sent at (s from the run's start), latency (s), tokens];
        # under one shared arrival sequence, whether every system's slowest came in the same bursts
        "slowest": [[round(r[1], 3), round(r[2] - r[1], 3), r[4]]
                    for r in sorted(ok, key=lambda r: r[2] - r[1])[-max(1, math.ceil(len(ok) / 100)):]],
    }


def scrape(url: str) -> dict:
    """Batch statistics from a Tessera server's /metrics and /info."""
    import httpx

    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tessera_batch") and ("_sum " in line or "_count " in line):
            name, value = line.split(" ")
            values[name] = float(value)
    count = values.get("tessera_batch_size_count", 0) or 1
    real = values.get("tessera_batch_tokens_sum", 0) or 1
    info = httpx.get(url + "/info", timeout=10).json()["tessera"]
    return {
        "batches": int(values.get("tessera_batch_size_count", 0)),
        "mean_batch_size": values.get("tessera_batch_size_sum", 0) / count,
        "padding_overhead": values.get("tessera_batch_computed_tokens_sum", 0) / real - 1,
        "cost_table": info["scheduler"].get("cost_table"),
        # the instruction sets the dense kernels ran ("amx", "avx512", "avx2"); absent on torch's
        "dense_isas": info["runner"].get("dense_isas"),
    }


def agreement(url: str, path: str, texts: list[str], reference) -> float:
    """Max |difference| between a system's embeddings of ``texts`` (normalised here, in
    case a system does not) and the model's: the same model served, the same pooling."""
    import httpx
    import numpy as np

    body = httpx.post(url + path, json={"input": texts, "model": "bench"}, timeout=300).json()
    got = np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])])
    got /= np.linalg.norm(got, axis=1, keepdims=True)
    return float(np.abs(got - reference).max())
