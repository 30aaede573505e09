"""`tessera bench serve`: variable-length serving under a real HTTP load.

TurboTransformers' workload: request lengths uniform in [5, 500] tokens, one text per
request, on a MiniLM-size encoder (6 layers, 384 wide, random weights, built here and saved
with save_pretrained). Every system serves the same folder, each in a server process of
its own pinned to core 0 with 1 torch thread; the load generator (`tessera.serve.loadgen`)
runs in another process pinned to core 1, speaking OpenAI's ``/embeddings`` to all:

- ``one_by_one``: Tessera's server, one request per batch (unpadded: nothing to pad);
- ``fifo_padded``: arrival-order batches under the padded token budget, padded runner
  (text-embeddings-inference's path for padded backends);
- ``sort_window``: infinity-emb's sorted windows, padded runner;
- ``tessera``: the DP scheduler over the length-sorted queue + the unpadded runner;
- ``tessera_memplan``: the same with the memory plan (attention padded, head by head;
  in ``--quick`` only);
- ``infinity``: infinity-emb itself (optional: installed into a virtual environment of
  its own under ``.cache/``, telemetry off, offline; reported absent when it cannot be).

Per system: saturation throughput (``concurrency`` closed-loop clients, so requests always
wait), then open-loop Poisson arrivals at 25/50/75/90% of that system's own saturation:
throughput (requests/s, tokens/s), p50/p90/p99 latency, goodput (requests answered within
``slo_s`` per second). Headline: Tessera / FIFO padded and Tessera / infinity-emb
saturation throughput, and p99 latency at 75% load.

Full run on 2 cores: at most 12 minutes (infinity's first install a few more);
``--quick``: a tiny encoder, two load points, infinity only if already installed, about 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tessera.bench.harness import BenchResult
from tessera.bench.serve_memory import measure_memory_plan, memory_note, memory_table
from tessera.bench.serve_systems import (
    bench_env,
    ensure_infinity,
    infinity_server,
    pin_to,
    server_and_client_cores,
    tessera_server,
)
from tessera.serve.synthetic import MINILM, EncoderSpec, build_encoder, words

CACHE = Path(".cache/bench-serve")


@dataclass(frozen=True, kw_only=True)
class ServeBenchPlan:
    spec: EncoderSpec = MINILM
    min_tokens: int = 5
    max_tokens: int = 500
    warmup_requests: int = 16
    saturation_requests: int = 96
    concurrency: int = 64
    # Requests per load point: most at 75% (where the headline p99 is read), fewer at 25%
    # where each takes 4x a saturated request's time; sized so the full run fits 12 minutes.
    fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9)
    load_requests: tuple[int, ...] = (40, 48, 120, 80)
    check_texts: int = 6  # inputs each system embeds once, compared with the model run alone
    # tessera_memplan (the memory plan under load) is in --quick only: the full run's 12
    # minutes hold five systems; its memory figures come from tests/serve/test_memory_plan.py.
    systems: tuple[str, ...] = ("one_by_one", "fifo_padded", "sort_window", "tessera", "infinity")
    slo_s: float = 2.0  # goodput counts answers within this
    install_infinity: bool = True
    memory_plan: bool = True  # measure the memory plan on the workload's batches, in process
    seed: int = 0
    extra_server_args: tuple[str, ...] = field(default_factory=tuple)


FULL = ServeBenchPlan()
QUICK = ServeBenchPlan(
    spec=EncoderSpec(layers=2, hidden=64, heads=4, vocab_size=1000, max_length=512),
    warmup_requests=8,
    saturation_requests=48,
    concurrency=16,
    fractions=(0.5, 0.75),
    load_requests=(24, 24),
    check_texts=3,
    slo_s=0.5,
    systems=("one_by_one", "fifo_padded", "sort_window", "tessera", "tessera_memplan", "infinity"),
    install_infinity=False,
)


# ---- the workload and the model ---------------------------------------------------------


def workload(plan: ServeBenchPlan, n: int, seed: int) -> tuple[list[str], list[int]]:
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(plan.min_tokens, plan.max_tokens) for _ in range(n)]
    texts = [
        words(k, seed=seed * 100_003 + i, vocab_size=plan.spec.vocab_size) for i, k in enumerate(lengths)
    ]
    return texts, lengths


def model_folder(spec: EncoderSpec, cache: Path = CACHE) -> Path:
    folder = cache / f"{spec.family}-{spec.layers}x{spec.hidden}-v{spec.vocab_size}-s{spec.seed}"
    if not (folder / "config.json").exists():
        build_encoder(folder, spec)
    return folder


# ---- load and its analysis ----------------------------------------------------------------


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
    }


def measure_system(url: str, path: str, plan: ServeBenchPlan, core, seed: int) -> list[dict]:
    def job(mode: str, n: int, k: int, **extra) -> dict:
        texts, tokens = workload(plan, n, seed * 1000 + k)
        return {"url": url, "path": path, "mode": mode, "texts": texts, "tokens": tokens, "seed": k, **extra}

    run_load(job("closed", plan.warmup_requests, 0, concurrency=4), core)
    sat = summarize(run_load(job("closed", plan.saturation_requests, 1, concurrency=plan.concurrency), core),
                    plan.slo_s)  # fmt: skip
    rows = [{"load": "saturation", "offered_rps": None, **sat}]
    for k, (fraction, n) in enumerate(zip(plan.fractions, plan.load_requests, strict=True), start=2):
        rate = fraction * sat["throughput_rps"]
        stats = summarize(run_load(job("open", n, k, rate=rate), core), plan.slo_s)
        rows.append({"load": f"{fraction:.0%}", "offered_rps": rate, **stats})
    return rows


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
    }


def reference_embeddings(plan: ServeBenchPlan, folder: Path):
    """A few workload texts and their unit embeddings from the model alone, one at a time
    (mean pooling, as every system here is configured)."""
    import torch.nn.functional as F

    from tessera.serve.model import load_model, reference_outputs

    texts, _ = workload(plan, plan.check_texts, seed=99)
    served = load_model(folder)
    rows = reference_outputs(served, served.tokenizer(texts)["input_ids"])
    return texts, F.normalize(rows, dim=-1).numpy()


def agreement(url: str, path: str, texts: list[str], reference) -> float:
    """Max |difference| between a system's embeddings of ``texts`` (normalised here, in
    case a system does not) and the model's: the same model served, the same pooling."""
    import httpx
    import numpy as np

    body = httpx.post(url + path, json={"input": texts, "model": "bench"}, timeout=300).json()
    got = np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])])
    got /= np.linalg.norm(got, axis=1, keepdims=True)
    return float(np.abs(got - reference).max())


# ---- the benchmark ------------------------------------------------------------------------


def run_serve_bench(
    quick: bool = False, progress: bool = True, plan: ServeBenchPlan | None = None, cache: Path = CACHE
) -> BenchResult:
    plan = plan or (QUICK if quick else FULL)
    folder = model_folder(plan.spec, cache)
    log_dir = cache / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    server_core, client_core = server_and_client_cores()
    rows, systems, absent = [], {}, {}
    check = reference_embeddings(plan, folder)
    for system in plan.systems:
        if system == "infinity":
            reason = ensure_infinity(plan.install_infinity)
            if reason:
                absent[system] = reason
                _say(progress, f"infinity-emb absent: {reason}")
                continue
        _say(progress, f"{system}: starting")
        try:
            server = (infinity_server(folder, server_core, log_dir) if system == "infinity"
                      else tessera_server(system, folder, plan.extra_server_args, server_core, log_dir))  # fmt: skip
        except RuntimeError as exc:
            absent[system] = f"server failed to start: {exc}"
            _say(progress, f"{system}: {absent[system]}")
            continue
        try:
            path = "/embeddings" if system == "infinity" else "/v1/embeddings"
            agrees = {"max_abs_diff_vs_model": agreement(server.url, path, *check)}
            measured = measure_system(server.url, path, plan, client_core, plan.seed)
            systems[system] = agrees | (scrape(server.url) if system != "infinity" else {})
        finally:
            server.stop()
        for row in measured:
            rows.append({"system": system, **row})
            _say(
                progress,
                f"{system} {row['load']}: {row['throughput_rps']:.2f} req/s, p99 {row['p99_s']:.3f} s",
            )
    memory = None
    if plan.memory_plan:
        _say(progress, "memory plan on the saturation workload's batches (in process)")
        lengths = workload(plan, plan.saturation_requests, plan.seed * 1000 + 1)[1]
        memory = measure_memory_plan(folder, lengths)
    return _result(plan, rows, systems, absent, folder, memory)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"bench serve: {message}", flush=True)


def _find(rows, system, load):
    return next((r for r in rows if r["system"] == system and r["load"] == load), None)


def _ratio(rows, a, b):
    ra, rb = _find(rows, a, "saturation"), _find(rows, b, "saturation")
    return round(ra["throughput_rps"] / rb["throughput_rps"], 3) if ra and rb else None


def _result(plan, rows, systems, absent, folder, memory) -> BenchResult:
    headline = {
        "tessera_over_fifo_padded_throughput": _ratio(rows, "tessera", "fifo_padded"),
        "tessera_over_infinity_throughput": _ratio(rows, "tessera", "infinity"),
        "tessera_over_sort_window_throughput": _ratio(rows, "tessera", "sort_window"),
        "tessera_over_one_by_one_throughput": _ratio(rows, "tessera", "one_by_one"),
    }
    if memory:
        headline["memory_plan_max_footprint_over_peak_live"] = round(memory["max_ratio"], 3)
        big = memory[
            "max_ratio_over_16_mib"
        ]  # batches of several 2 MiB chunks, where the plan's packing shows
        headline["memory_plan_max_footprint_over_peak_live_16mib_up"] = round(big, 3) if big else None
        headline["memory_plan_steady_state_allocations"] = memory["second_pass"]["allocations"]
        headline["memory_plan_held_over_largest_peak_live"] = round(memory["held_over_largest_peak"], 3)
        headline["memory_plan_second_pass_chunk_allocations"] = memory["second_pass"]["chunk_allocations"]
    for system in plan.systems:
        at75 = _find(rows, system, "75%")
        headline[f"{system}_p99_at_75pct_s"] = round(at75["p99_s"], 4) if at75 else None
    notes = [
        f"encoder: {plan.spec.family} {plan.spec.layers} layers x {plan.spec.hidden} wide, random weights ({folder})",
        f"requests: one text each, uniform in [{plan.min_tokens}, {plan.max_tokens}] tokens; "
        f"saturation: {plan.saturation_requests} requests from {plan.concurrency} closed-loop clients; loads: "
        f"{'/'.join(map(str, plan.load_requests))} open-loop Poisson requests at "
        f"{'/'.join(f'{f:.0%}' for f in plan.fractions)} of the system's own saturation",
        "servers pinned to one core with 1 torch thread, the load generator to another core",
        f"goodput: answers within {plan.slo_s} s per second",
        *[f"{name} absent: {why}" for name, why in absent.items()],
    ]
    extra = {"plan": {k: v for k, v in asdict(plan).items() if k != "spec"} | {"spec": asdict(plan.spec)},
             "systems": systems, "absent": absent, "dp_plan_us_per_request": _dp_speed(systems)}  # fmt: skip
    columns = ["system", "load", "offered_rps", "throughput_rps", "tokens_per_s", "p50_s", "p90_s", "p99_s",
               "goodput_rps", "ok", "errors"]  # fmt: skip
    batch_rows = [
        {"system": k, **{m: v for m, v in s.items() if m != "cost_table"}} for k, s in systems.items()
    ]
    batch_columns = ["system", "batches", "mean_batch_size", "padding_overhead", "max_abs_diff_vs_model"]
    title = "Batches, padding, and each system's embeddings against the model run alone"
    tables = [(title, batch_columns, batch_rows)]
    if memory:
        tables.append(memory_table(memory))
        notes.append(memory_note(memory))
        extra["memory_plan"] = memory
    return BenchResult("serve", headline, rows, columns, notes=notes, extra=extra, tables=tables)


def _dp_speed(systems: dict) -> float | None:
    """The DP's planning time for a 256-request queue, on the measured cost table."""
    import random

    from tessera.serve.cost import CostTable
    from tessera.serve.dp_scheduler import DPScheduler
    from tessera.serve.request import Request
    from tessera.serve.scheduler import BatchLimits

    table = (systems.get("tessera") or {}).get("cost_table")
    if not table:
        return None
    scheduler = DPScheduler(BatchLimits(), CostTable.from_dict(table))
    rng = random.Random(0)
    queue = [Request([1] * rng.randint(5, 500)) for _ in range(256)]
    scheduler.plan(queue)
    began = time.perf_counter()
    for _ in range(10):
        scheduler.plan(queue)
    return round((time.perf_counter() - began) / 10 / 256 * 1e6, 2)


def plot_serve(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in dict.fromkeys(r["system"] for r in result.rows):
        mine = [r for r in result.rows if r["system"] == system and r["load"] != "saturation"]
        mine.sort(key=lambda r: r["throughput_rps"])
        for ax, key in zip(axes, ("p50_s", "p99_s"), strict=True):
            ax.plot([r["throughput_rps"] for r in mine], [r[key] for r in mine], marker="o", label=system)
    for ax, title in zip(axes, ("p50 latency", "p99 latency"), strict=True):
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.set_title(f"{title} vs throughput")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("open-loop Poisson load at 25/50/75/90% of each system's own saturation")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
