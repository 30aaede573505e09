"""`tessera bench serve` end to end on a small plan: each configuration is started as a real
server process and loaded by the load generator in its own process; the sweep measures every
peer at every batch size on validation requests and keeps its best, the finals repeat the
best configurations and Tessera on other requests, and one shared rate loads every finalist
alike. Every request is answered, each system serves the model's own embeddings, the padded
baseline pads and Tessera does not, infinity-emb is either measured or said absent, and the
results are written."""

import dataclasses
import json
import math
import os

from tessera.bench.harness import write_results
from tessera.bench.serve import QUICK, plot_serve, run_serve_bench

PLAN = dataclasses.replace(
    QUICK, peers=("fifo_padded", "infinity_torch"), batch_sizes=(4, 32), sweep_extra=(), sweep_requests=16,
    saturation_requests=16, repeats=1, shared_requests=12,
)  # fmt: skip  (one repeat: each server start costs seconds; the rounds' order is tested alone below)


def test_small_serve_bench(tmp_path):
    result = run_serve_bench(progress=False, plan=PLAN, cache=tmp_path / "cache")
    (model,) = result.headline.keys() - {"memory_plan", "dp_plan_us_per_request"}
    absent = result.extra["absent"]
    rows = result.rows
    sweep = {(r["system"], r["batch"]) for r in rows if r["phase"] == "sweep"}
    assert {("fifo_padded", 4), ("fifo_padded", 32)} <= sweep
    infinity = ("infinity_torch", 4) in sweep
    assert infinity != ("infinity_torch" in absent)  # measured, or said why not
    facts = result.extra["models"][model]
    finalists = [*facts["peers_ranked"], "one_by_one", "tessera"]
    for system in finalists:
        mine = [r for r in rows if r["phase"] == "final" and r["system"] == system]
        assert [r["repeat"] for r in mine] == [0]
        if system in facts["best_batch"]:  # a peer's finals run at its best sweep batch size
            assert {r["batch"] for r in mine} == {facts["best_batch"][system]}
    assert sorted(r["system"] for r in rows if r["phase"] == "final") == sorted(finalists)
    layouts = [(r["system"], r["repeat"]) for r in rows if r["phase"] == "workers"]
    assert layouts[:2] == [("tessera_1x2", 0), ("tessera_2x1", 0)]
    assert result.headline[model]["workers_2x1_over_1x2"] > 0
    shared = [r for r in rows if r["phase"] == "shared_rate"]
    # beside each final: repeat i offers every system the same arrivals
    assert sorted((r["system"], r["repeat"]) for r in shared) == sorted((f, 0) for f in finalists)
    assert len({r["offered_rps"] for r in shared}) == 1  # one rate for all
    for row in rows:
        assert row["errors"] == 0 and row["ok"] == row["requests"], row
        assert row["throughput_rps"] > 0 and 0 < row["p50_s"] <= row["p99_s"]
    systems = result.extra["systems"][model]
    # fp32 unit vectors, the packed batch against one input alone: see test_unpadded for 1e-5.
    assert systems["tessera"]["max_abs_diff_vs_model"] < 1e-5
    assert systems["fifo_padded@4"]["max_abs_diff_vs_model"] < 1e-5
    if infinity:  # its own padded batches; CLS instead of mean pooling would be off by ~0.1
        # 1e-4: another server's fp32 forward (its own padding, kernels and pooling code), so 10x
        # the 1e-5 of our own batches, still 1000x below the ~0.1 of a wrong pooling
        assert systems["infinity_torch@4"]["max_abs_diff_vs_model"] < 1e-4
    if len(os.sched_getaffinity(0)) >= 2:  # what each server really ran on, read back from /proc
        for label, facts_of in systems.items():
            two_cores = label.startswith(("tessera_1x2", "tessera_2x1", "infinity_optimum_2cores"))
            allowed = facts_of["cpus_allowed"]
            assert (len(allowed) >= 2) if two_cores else (len(allowed) == 1), (label, allowed)
    assert systems["fifo_padded@32"]["padding_overhead"] > 0.05  # padded to the longest of a batch
    assert systems["tessera"]["padding_overhead"] == 0 and systems["tessera"]["cost_table"]["seconds"]
    head = result.headline[model]
    ratio, spread = head["tessera_over_best_peer"], head["tessera_over_best_peer_range"]
    assert math.isfinite(ratio) and ratio > 0 and spread[0] <= spread[1]
    assert head["best_peer"].split("@")[0] in facts["peers_ranked"]
    low, high = head["tessera_p99_at_shared_rate_range_s"]
    assert low <= head["tessera_p99_at_shared_rate_s"] <= high
    low, high = head["tessera_p99_over_best_peer_at_shared_rate_range"]
    assert 0 < low <= head["tessera_p99_over_best_peer_at_shared_rate"] <= high
    # the compute bound: the FMA peak measured on the servers' core around the finals, and each
    # system's useful rate under it (the workload's unpadded FLOPs a request x its saturation)
    assert head["fma_peak_gflops_1_core"] and head["gflop_per_request"] > 0
    # (no server computes faster than the FMA peak: both fractions below 1, the ceiling above it)
    assert 0 < head["best_peer_fraction_of_peak"] < 1 and 0 < head["tessera_fraction_of_peak"] < 1
    assert head["peak_over_best_peer"] > 1
    assert result.headline["dp_plan_us_per_request"] > 0  # measured (its bound: test_dp_scheduler)
    memory = result.extra["memory_plan"]  # the plan on the workload's batches, in process
    assert memory["first_pass"]["allocations"] == memory["second_pass"]["allocations"] == 0
    assert memory["held_mib"] > 0 and memory["max_ratio"] >= 1  # a placement never beats the peak
    paths = write_results(result, tmp_path, plot_serve)
    data = json.loads(paths[0].read_text())
    assert data["headline"][model]["best_batch"] and data["rows"]
    assert paths[2].stat().st_size > 10_000


def test_rounds_start_every_system_once_a_round_in_rotated_order():
    """Repeat i of every system in round i, the order rotated by one each round, so the VM's
    drift over a phase falls on every system alike (finals and the two-core layouts)."""
    from tessera.bench import serve

    bench = serve._Bench.__new__(serve._Bench)
    bench.plan = dataclasses.replace(QUICK, repeats=4)
    started = []
    bench.serve = lambda system, batch, work, core="default": started.append(
        (system, batch, work.keywords["repeat"], core))  # fmt: skip
    bench.rounds([("a", 1), ("b", None), ("c", 8)], work=print, core=None)
    order = [(system, repeat) for system, _, repeat, _ in started]
    assert order == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1),
                     ("c", 2), ("a", 2), ("b", 2), ("a", 3), ("b", 3), ("c", 3)]  # fmt: skip
    assert {(system, batch) for system, batch, _, _ in started} == {("a", 1), ("b", None), ("c", 8)}
    assert {core for *_, core in started} == {None}


def test_summary_names_the_slowest_hundredth_with_their_arrival_times():
    from tessera.bench.serve_load import summarize

    # [index, sent, finished, status, tokens]: request i sent at i/10 s, taking (i % 97)/100 s
    records = [[i, i / 10, i / 10 + (i % 97) / 100, 200, 5 + i] for i in range(250)]
    records.append([250, 30.0, 31.0, 500, 9])  # an error: not among the answered
    stats = summarize(records, slo_s=0.5)
    slowest = stats["slowest"]
    assert len(slowest) == 3  # ceil(250 / 100) of the answered
    # the longest are 0.96 s (i = 96, 193) and 0.95 s (i = 95, 192; the later one kept)
    assert [row[1] for row in slowest] == [0.95, 0.96, 0.96] and stats["p99_s"] <= slowest[-1][1]
    assert sorted(row[0] for row in slowest) == [9.6, 19.2, 19.3] and all(row[2] == 5 + round(row[0] * 10) for row in slowest)


def test_request_flops_match_torch_flop_counter(tmp_path):
    # every multiply-add the unpadded forward does, attention's included (eager attention, so
    # torch's counter sees its two matmuls; no pooler: the served embedding is pooled tokens)
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModel

    from tessera.bench.serve import request_gflop
    from tessera.serve.synthetic import EncoderSpec, build_encoder

    spec = EncoderSpec(layers=2, hidden=64, heads=4, intermediate=96, vocab_size=1000, max_length=512)
    build_encoder(tmp_path, spec)
    model = AutoModel.from_pretrained(tmp_path, attn_implementation="eager", add_pooling_layer=False).eval()
    for tokens in (5, 37):
        with FlopCounterMode(display=False) as counter, torch.inference_mode():
            model(input_ids=torch.randint(5, 900, (1, tokens)))
        assert counter.get_total_flops() == round(request_gflop(spec, tokens) * 1e9)


def test_one_model_runs_as_in_the_whole_plan(monkeypatch):
    """`tessera bench serve --model M`: only M's phases run, as they would in the whole plan (a
    model after the first is lean; the two-core and memory-plan phases stay the first's), and
    the result is named for M; a model not in the plan is refused before anything runs."""
    from tessera.bench import serve
    from tessera.bench.harness import BenchResult

    ran = []

    class FakeBench:
        def __init__(self, plan, spec, cache, progress, absent):
            self.model, self.rows, self.systems, self.folder = serve.model_name(spec), [], {}, cache

        def run(self, lean):
            ran.append(("run", self.model, lean))
            return {}

        def workers(self):
            ran.append(("workers", self.model))

    monkeypatch.setattr(serve, "_Bench", FakeBench)
    monkeypatch.setattr(serve, "measure_memory_plan", lambda *a: ran.append(("memory",)))
    monkeypatch.setattr(serve, "result", lambda plan, rows, systems, absent, models, memory: BenchResult(
        "serve", {m: {} for m in models}, rows, []))  # fmt: skip
    got = serve.run_serve_bench(progress=False, only="12x768")
    assert ran == [("run", "12x768", True)] and got.name == "serve-12x768" and list(got.headline) == ["12x768"]
    assert "12x768 alone" in got.notes[-1]
    ran.clear()
    assert serve.run_serve_bench(progress=False, only="6x384").name == "serve-6x384"
    assert ran == [("run", "6x384", False), ("workers", "6x384"), ("memory",)]
    ran.clear()
    try:
        serve.run_serve_bench(progress=False, only="7x7")
    except ValueError as exc:
        assert "'7x7' is not in the plan; choose one of 6x384, 12x768" in str(exc)
    else:
        raise AssertionError("an unknown model ran")
    assert ran == []
