"""`tessera bench train --quick` on FSDP2 and Tessera ZeRO-3 (block chunks): both train the
same model to the same loss, the model state each rank holds is counted from its tensors,
and the results are written."""

import json

from tessera.bench.harness import write_results
from tessera.bench.train import QUICK, plot_train, run_train_bench


def test_quick_train_bench_fsdp2_and_tessera_zero3(tmp_path):
    result = run_train_bench(
        quick=True, progress=False, variants=["fsdp2", "tessera_zero3", "tessera_dp"], checkpoints=False
    )
    rows = {r["variant"]: r for r in result.rows}
    assert rows.keys() == {"fsdp2", "tessera_zero3", "tessera_dp"}
    # same model, data and optimizer: the same loss to fp32 rounding (the committed full run:
    # equal to every printed digit, ~11.0); 1e-3 is loose, kept for another machine's kernels
    assert abs(rows["fsdp2"]["final_loss"] - rows["tessera_zero3"]["final_loss"]) < 1e-3
    assert rows["tessera_zero3"]["comm_mib_per_step"]["reduce_scatter@dp"] > 0
    # a chunk per block plus the root's parameters (embeddings; final norm), as FSDP2 wraps them
    assert rows["tessera_zero3"]["chunks_per_rank"] == QUICK.n_layer + 2
    full = json.loads(json.dumps(result.extra))["parameters"] * 4 / 2**20
    dp, z3, fsdp = rows["tessera_dp"], rows["tessera_zero3"], rows["fsdp2"]
    # replicated: whole parameters, gradients and two Adam moments; sharded over 2 ranks: half.
    # The rows round MiB to one decimal (+-0.05); sharded: a sum of rounded parts and the
    # shards' padding, so 0.1
    assert abs(dp["params_mib"] - full) < 0.05 and abs(dp["optimizer_mib"] - 2 * full) < 0.05
    for sharded in (z3, fsdp):
        assert abs(sharded["model_state_mib_per_rank"] - 2 * full) < 0.1, sharded
    assert (
        "zero3_tokens_per_s_vs_fsdp2" in result.headline
        and "zero3_peak_mem_vs_fsdp2_range" in result.headline
    )
    paths = write_results(result, tmp_path, plot_train)
    assert json.loads(paths[0].read_text())["parameters"] > 0


def test_train_bench_checkpoint_section(tmp_path, monkeypatch):
    """The checkpoint section of `tessera bench train`: a run with no checkpoints, one saving
    synchronously and one in the background, in the same run; each saving run commits one
    checkpoint per interval, and the section's rows, headline and plot panels land in the
    train results. (The recovery half is the chaos tests' subject: kills=0 here.)"""
    from tessera.bench import checkpoint

    tiny = checkpoint.CheckpointBenchConfig(
        n_embd=32,
        n_layer=1,
        n_head=2,
        vocab=64,
        seq=16,
        batch=2,
        warmup=1,
        steps=4,
        every=2,
        repeats=1,
        kills=0,
    )
    monkeypatch.setattr(checkpoint, "QUICK", tiny)
    result = run_train_bench(quick=True, progress=False, variants=["tessera_zero3"], checkpoints=True)
    section = result.extra["checkpoint"]
    saves = {r["variant"]: r["saves"] for r in section["rows"]}
    assert saves == {"none": 0, "sync": 2, "async": 2}  # 4 timed steps, a save every 2
    assert section["checkpoint_mib"] > 0  # the committed checkpoint's files, measured on disk
    for key in (
        "checkpoint_async_overhead_pct",
        "checkpoint_sync_blocked_ms_per_save",
        "checkpoint_interval_s",
    ):
        assert key in result.headline, key
    paths = write_results(result, tmp_path, plot_train)
    assert "Checkpoints: tokens/s with a checkpoint every N steps" in paths[1].read_text()
    assert paths[2].stat().st_size > 0


def test_spread_of_zero_peaks_is_zero_not_an_error():
    # a --quick model's memory growth can be 0 MiB on every repeat (CI saw it)
    from tessera.bench.train import _spread

    assert _spread([0.0])["spread_pct"] == 0.0
    assert _spread([0.0, 0.0, 2.0])["spread_pct"] == 100.0  # relative to the largest
    assert _spread([1.0, 2.0, 3.0])["spread_pct"] == 100.0
