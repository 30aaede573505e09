"""`tessera bench serve`: variable-length serving under a real HTTP load, against peers each
at its best configuration.

TurboTransformers' workload: request lengths uniform in [5, 500] tokens, one text per
request, on encoders built here from configs (random weights, saved with save_pretrained):
a MiniLM-size one (6 layers, 384 wide) and a BERT-base-size one (12 layers, 768). Every
system serves the same folder in a server process of its own pinned to core 0 with 1 torch
thread (ONNX Runtime held to one thread: it pins its own workers to other cores; each
server's real affinity is read back and reported); the load generator (`tessera.serve.loadgen`) runs in another process pinned to core
1, speaking OpenAI's ``/embeddings`` to all.

Systems: ``tessera`` (the DP scheduler over the length-sorted queue, the unpadded runner, its
dense layers on Tessera's kernels); peers: ``fifo_padded`` (arrival-order padded batches:
text-embeddings-inference's path for padded backends), ``sort_window`` (infinity-emb's
sorted windows, padded), ``infinity_torch`` and ``infinity_optimum`` (infinity-emb itself
with each CPU engine it offers: torch, and ONNX Runtime through optimum, in a virtual
environment of its own; said absent when it cannot be installed or started), and
``one_by_one`` (the simplest server). ``tessera_torch_kernels`` (Tessera on torch's dense
kernels) shows what the kernels add, ``tessera_avx`` (its kernels on AVX only; measured where
the CPU has AMX-BF16) what the AMX kernel adds.

Three phases per model, each on its own requests (seeded apart):

1. Sweep (the validation workload): every peer at each batch size in ``batch_sizes``; each
   peer keeps its fastest (saturation from ``sweep_requests`` closed-loop requests).
2. Finals (test workloads, never used in the sweep): each peer's best configuration,
   ``one_by_one`` and ``tessera``; saturation from ``saturation_requests`` requests after a
   warm-up, ``repeats`` times (repeat i uses the same requests for every system): median and
   range; Tessera's ratio to the best peer per repeat. In rounds: round i starts each finalist
   in turn (the order rotated each round) and runs its i-th repeat, so the VM's drift over
   the phase falls on every system alike.
3. One shared rate: open-loop Poisson arrivals at ``shared_fraction`` of the best peer's
   sweep saturation, the same for every finalist, so their p50/p99 compare (in the same
   rounds, after each saturation repeat).

Then, on the first model, two cores for the server: Tessera as one engine worker of two
threads and as two workers of one thread, and infinity's ONNX Runtime engine with its own
default thread pool at its best batch size.

``--quick``: a tiny encoder, a small sweep and one repeat, infinity only if installed.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tessera.bench.harness import BenchResult
from tessera.bench.serve_load import agreement, run_load, scrape, summarize
from tessera.bench.serve_memory import measure_memory_plan
from tessera.bench.serve_report import plot_serve, result
from tessera.bench.serve_systems import (
    INFINITY_ENGINES,
    ensure_infinity,
    server_and_client_cores,
    start_server,
)
from tessera.serve.synthetic import BERT_BASE, MINILM, EncoderSpec, build_encoder, words

CACHE = Path(".cache/bench-serve")
PEERS = ("fifo_padded", "sort_window", "infinity_torch", "infinity_optimum")


@dataclass(frozen=True, kw_only=True)
class ServeBenchPlan:
    specs: tuple[EncoderSpec, ...] = (MINILM, BERT_BASE)
    min_tokens: int = 5
    max_tokens: int = 500
    warmup_requests: int = 16
    peers: tuple[str, ...] = PEERS
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16, 32)  # each peer's batch-size knob, swept
    sweep_requests: int = 150
    sweep_extra: tuple[str, ...] = ("tessera", "tessera_torch_kernels", "tessera_avx")  # measured once in the sweep
    saturation_requests: int = 1000
    repeats: int = 3
    concurrency: int = 64
    shared_fraction: float = 0.75
    shared_requests: int = 300
    # two cores, the first model only: one engine worker of 2 threads against 2 workers of 1
    # thread (the server on both cores, the load generator beside it), saturation repeated
    workers_requests: int = 300
    # models after the first run their finals on the best peer and Tessera only (BERT-base
    # takes about 4x MiniLM's time a request)
    lean_after_first: bool = True
    check_texts: int = 6  # inputs each system embeds once, compared with the model run alone
    slo_s: float = 2.0  # goodput counts answers within this
    install_infinity: bool = True
    memory_plan: bool = True  # measure the memory plan on the workload's batches, in process
    seed: int = 0
    extra_server_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown or not self.specs or self.repeats < 1 or not self.batch_sizes:
            raise ValueError(
                f"ServeBenchPlan: peers {self.peers} must come from {PEERS}; specs, repeats >= 1 and "
                f"batch_sizes must not be empty"
            )


FULL = ServeBenchPlan()
QUICK = ServeBenchPlan(
    specs=(EncoderSpec(layers=2, hidden=64, heads=4, vocab_size=1000, max_length=512),),
    warmup_requests=8,
    batch_sizes=(4, 32),
    sweep_requests=24,
    saturation_requests=32,
    repeats=1,
    concurrency=16,
    shared_requests=16,
    workers_requests=16,
    check_texts=3,
    slo_s=0.5,
    install_infinity=False,
)


# ---- the workload and the model ---------------------------------------------------------


def workload(plan: ServeBenchPlan, spec: EncoderSpec, n: int, seed: int) -> tuple[list[str], list[int]]:
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(plan.min_tokens, plan.max_tokens) for _ in range(n)]
    texts = [words(k, seed=seed * 100_003 + i, vocab_size=spec.vocab_size) for i, k in enumerate(lengths)]
    return texts, lengths


def request_gflop(spec: EncoderSpec, tokens: int) -> float:
    """The multiply-adds (x2) of one unpadded request of ``tokens`` tokens: every layer's Q, K,
    V and output projections and its MLP on each token, and attention's QK^T and PV."""
    h, inner = spec.hidden, spec.intermediate or 4 * spec.hidden
    dense = 2 * tokens * (4 * h * h + 2 * h * inner)
    attention = 4 * tokens * tokens * h
    return spec.layers * (dense + attention) / 1e9


def fma_peak_gflops(core: int | None, seconds: float = 0.5) -> float | None:
    """The FP32 FMA peak of one thread on ``core`` (the servers' core), measured now: the rate
    any exact float32 server there is bounded by. None where Tessera's kernels cannot build."""
    import os

    from tessera.kernels.machine import cpu_isas, peak_flops

    if not cpu_isas():
        return None
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        if core is not None and before is not None:
            os.sched_setaffinity(0, {core})
        return round(peak_flops(1, seconds=seconds) / 1e9, 1)
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)


def model_folder(spec: EncoderSpec, cache: Path = CACHE) -> Path:
    folder = cache / f"{spec.family}-{spec.layers}x{spec.hidden}-v{spec.vocab_size}-s{spec.seed}"
    if not (folder / "config.json").exists():
        build_encoder(folder, spec)
    return folder


# ---- load ---------------------------------------------------------------------------------


def saturation(url: str, path: str, plan: ServeBenchPlan, spec: EncoderSpec, core, n: int, seed: int) -> dict:
    job = _job(url, path, plan, spec, "closed", n, seed, concurrency=plan.concurrency)
    return summarize(run_load(job, core), plan.slo_s)


def warm_up(url: str, path: str, plan: ServeBenchPlan, spec: EncoderSpec, core) -> None:
    job = _job(url, path, plan, spec, "closed", plan.warmup_requests, _seed(plan, "warmup"), concurrency=4)
    run_load(job, core)


def _job(url: str, path: str, plan: ServeBenchPlan, spec: EncoderSpec, mode: str, n: int, seed: int,
         **extra) -> dict:  # fmt: skip
    texts, tokens = workload(plan, spec, n, seed)
    return {"url": url, "path": path, "mode": mode, "texts": texts, "tokens": tokens, "seed": seed, **extra}


def _seed(plan: ServeBenchPlan, phase: str, repeat: int = 0) -> int:
    """Each phase's requests apart: the sweep's (validation) never reappear in the finals."""
    offsets = {"warmup": 0, "sweep": 100, "final": 200, "shared": 300, "check": 400}
    return plan.seed * 1000 + offsets[phase] + repeat


def reference_embeddings(plan: ServeBenchPlan, spec: EncoderSpec, folder: Path):
    """A few workload texts and their unit embeddings from the model alone, one at a time
    (mean pooling, as every system here is configured)."""
    import torch.nn.functional as F

    from tessera.serve.model import load_model, reference_outputs

    texts, _ = workload(plan, spec, plan.check_texts, seed=_seed(plan, "check"))
    served = load_model(folder)
    rows = reference_outputs(served, served.tokenizer(texts)["input_ids"])
    return texts, F.normalize(rows, dim=-1).numpy()


# ---- the benchmark ------------------------------------------------------------------------


class _Bench:
    """One model's three phases; rows and per-system facts accumulate on the instance."""

    def __init__(self, plan: ServeBenchPlan, spec: EncoderSpec, cache: Path, progress: bool, absent: dict):
        self.plan, self.spec, self.progress, self.absent = plan, spec, progress, absent
        self.model = model_name(spec)
        self.folder = model_folder(spec, cache)
        self.log_dir = cache / "logs" / self.model
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.server_core, self.client_core = server_and_client_cores()
        self.check = reference_embeddings(plan, spec, self.folder)
        self.rows: list[dict] = []
        self.systems: dict[str, dict] = {}
        self.best: dict[str, int | None] = {}

    def say(self, message: str) -> None:
        _say(self.progress, f"{self.model} {message}")

    def serve(self, system: str, batch: int | None, work, *, core="default") -> bool:
        """Start ``system`` (at ``batch``) on the server core (``core=None``: unpinned), run
        ``work(url, path)``, stop it; False when absent."""
        if system in INFINITY_ENGINES:
            reason = ensure_infinity(self.plan.install_infinity)
            if reason:
                self.absent[system] = reason
                return False
        label = system if batch is None else f"{system}@{batch}"
        self.say(f"{label}: starting")
        try:
            server = start_server(system, batch, self.folder, self.plan.extra_server_args,
                                  self.server_core if core == "default" else core, self.log_dir)  # fmt: skip
        except RuntimeError as exc:
            self.absent[label] = f"server failed to start: {str(exc).strip().splitlines()[-1:]}"
            self.say(f"{label}: {self.absent[label]}")
            return False
        try:
            path = "/embeddings" if system in INFINITY_ENGINES else "/v1/embeddings"
            facts = self.systems.setdefault(label, {})
            # a system started once a round: the worst agreement of its starts, and the batch
            # statistics of its last start (one round's work)
            diff = agreement(server.url, path, *self.check)
            facts["max_abs_diff_vs_model"] = max(diff, facts.get("max_abs_diff_vs_model", diff))
            warm_up(server.url, path, self.plan, self.spec, self.client_core)
            work(server.url, path)
            facts |= server.cores()
            if system not in INFINITY_ENGINES:
                facts |= scrape(server.url)
        finally:
            server.stop()
        return True

    def sweep(self) -> dict[str, int | None]:
        """Each peer's fastest batch size on the validation requests (and Tessera's, once)."""
        plan, best = self.plan, {}
        knobs = [(p, b) for p in plan.peers for b in plan.batch_sizes] + [(s, None) for s in plan.sweep_extra]
        for system, batch in knobs:

            def work(url, path, system=system, batch=batch):
                sat = saturation(url, path, plan, self.spec, self.client_core, plan.sweep_requests,
                                 _seed(plan, "sweep"))  # fmt: skip
                self.rows.append(
                    {"model": self.model, "phase": "sweep", "system": system, "batch": batch, **sat}
                )
                self.say(f"sweep {system}@{batch}: {sat['throughput_rps']:.2f} req/s")

            self.serve(system, batch, work)
        for system in plan.peers:
            mine = [r for r in self.rows if r["phase"] == "sweep" and r["system"] == system]
            if mine:
                best[system] = max(mine, key=lambda r: r["throughput_rps"])["batch"]
        return best

    def rounds(self, configs: list[tuple[str, int | None]], work, *, core="default") -> None:
        """``work(url, path, system, batch, repeat)`` in rounds: round i starts every system in
        turn (the order rotated by one each round), runs its i-th repeat, and stops it. One
        system's repeats back to back would let the VM's drift over a phase fall between systems
        and into their ratios (the FMA peak measured before and after the finals of the
        2026-12-05 run moved from 242.7 to 236.3 GFLOP/s)."""
        for repeat in range(self.plan.repeats):
            k = repeat % len(configs)
            for system, batch in configs[k:] + configs[:k]:
                self.serve(system, batch, functools.partial(work, system=system, batch=batch, repeat=repeat),
                           core=core)  # fmt: skip

    def finals(self, configs: list[tuple[str, int | None]], shared_rate: float) -> None:
        """Each repeat: saturation, then the shared rate (repeat i is the same arrivals for every
        system: one 300-request run's p99 is its third-worst request, and it moved by 1.5 s
        between two runs of the same arrivals here)."""
        plan = self.plan

        def work(url, path, *, system, batch, repeat):
            sat = saturation(url, path, plan, self.spec, self.client_core, plan.saturation_requests,
                             _seed(plan, "final", repeat))  # fmt: skip
            self.rows.append({"model": self.model, "phase": "final", "system": system, "batch": batch,
                              "repeat": repeat, **sat})  # fmt: skip
            self.say(f"final {system}@{batch} #{repeat}: {sat['throughput_rps']:.2f} req/s")
            job = _job(url, path, plan, self.spec, "open", plan.shared_requests,
                       _seed(plan, "shared", repeat), rate=shared_rate)  # fmt: skip
            stats = summarize(run_load(job, self.client_core), plan.slo_s)
            self.rows.append({"model": self.model, "phase": "shared_rate", "system": system, "batch": batch,
                              "repeat": repeat, "offered_rps": shared_rate, **stats})  # fmt: skip
            self.say(f"shared rate {shared_rate:.2f}/s {system} #{repeat}: p99 {stats['p99_s']:.3f} s")

        self.rounds(configs, work)

    def workers(self) -> None:
        """1 worker x 2 threads against 2 workers x 1 thread, the server on both cores; and
        infinity's ONNX Runtime engine with its default thread pool (one thread a core) at its
        best batch size, on the same two cores."""
        plan = self.plan
        layouts = [("tessera_1x2", None), ("tessera_2x1", None)]
        if "infinity_optimum" in self.best:
            layouts.append(("infinity_optimum_2cores", self.best["infinity_optimum"]))

        def work(url, path, *, system, batch, repeat):
            job = _job(url, path, plan, self.spec, "closed", plan.workers_requests,
                       _seed(plan, "final", repeat), concurrency=plan.concurrency)  # fmt: skip
            sat = summarize(run_load(job, None), plan.slo_s)
            self.rows.append({"model": self.model, "phase": "workers", "system": system, "batch": batch,
                              "repeat": repeat, **sat})  # fmt: skip
            self.say(f"workers {system} #{repeat}: {sat['throughput_rps']:.2f} req/s")

        self.rounds(layouts, work, core=None)

    def run(self, lean: bool) -> dict:
        best = self.best = self.sweep()
        sweep = {(r["system"], r["batch"]): r["throughput_rps"] for r in self.rows if r["phase"] == "sweep"}
        ranked = sorted(best, key=lambda p: sweep[p, best[p]], reverse=True)
        if not ranked:
            raise RuntimeError(f"no peer ran on {self.model}: {self.absent}")
        shared_rate = self.plan.shared_fraction * sweep[ranked[0], best[ranked[0]]]
        peers = ranked[:1] if lean else ranked
        configs = (
            [(p, best[p]) for p in peers] + ([] if lean else [("one_by_one", None)]) + [("tessera", None)]
        )
        peak = [fma_peak_gflops(self.server_core)]  # around the finals: the VM's speed drifts
        self.finals(configs, shared_rate)
        peak.append(fma_peak_gflops(self.server_core))
        lengths = [n for r in range(self.plan.repeats)
                   for n in workload(self.plan, self.spec, self.plan.saturation_requests, _seed(self.plan, "final", r))[1]]  # fmt: skip
        return {"best_batch": best, "peers_ranked": ranked, "shared_rate_rps": shared_rate,
                "gflop_per_request": statistics.fmean(request_gflop(self.spec, n) for n in lengths),
                "fma_peak_gflops": [p for p in peak if p]}  # fmt: skip


def model_name(spec: EncoderSpec) -> str:
    return f"{spec.layers}x{spec.hidden}"


def run_serve_bench(
    quick: bool = False, progress: bool = True, plan: ServeBenchPlan | None = None, cache: Path = CACHE,
    only: str | None = None,
) -> BenchResult:  # fmt: skip
    """The plan's models in order; ``only``: one of them (a name such as ``12x768``), run as in
    the whole plan (lean when it is not the first; the two-core and memory-plan phases belong to
    the first model), its result named ``serve-<model>`` (a full run takes over 2 hours)."""
    plan = plan or (QUICK if quick else FULL)
    names = [model_name(s) for s in plan.specs]
    if only is not None and only not in names:
        raise ValueError(f"bench serve: model {only!r} is not in the plan; choose one of {', '.join(names)}")
    rows, systems, absent, models = [], {}, {}, {}
    memory = None
    for i, spec in enumerate(plan.specs):
        if only is not None and names[i] != only:
            continue
        bench = _Bench(plan, spec, cache, progress, absent)
        models[bench.model] = bench.run(lean=plan.lean_after_first and i > 0)
        if i == 0 and plan.workers_requests:
            bench.workers()
        rows += bench.rows
        systems[bench.model] = bench.systems
        if plan.memory_plan and i == 0:
            _say(progress, "memory plan on the first model's final workload batches (in process)")
            lengths = workload(plan, spec, plan.saturation_requests, _seed(plan, "final"))[1]
            memory = measure_memory_plan(bench.folder, lengths)
    done = result(plan, rows, systems, absent, models, memory)
    if only is not None:
        done.notes.append(f"this run: model {only} alone, as in the whole plan (`tessera bench serve --model {only}`)")
        done = dataclasses.replace(done, name=f"serve-{only}")
    return done


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"bench serve: {message}", flush=True)


__all__ = ["FULL", "QUICK", "ServeBenchPlan", "plot_serve", "run_serve_bench"]
