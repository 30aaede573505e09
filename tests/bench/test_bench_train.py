"""`tessera bench train --quick` on two variants: both train the same model to the same loss,
and the results are written."""

import json

from tessera.bench.harness import write_results
from tessera.bench.train import plot_train, run_train_bench


def test_quick_train_bench_fsdp2_and_tessera_zero3(tmp_path):
    result = run_train_bench(quick=True, progress=False, variants=["fsdp2", "tessera_zero3"])
    rows = {r["variant"]: r for r in result.rows}
    assert rows.keys() == {"fsdp2", "tessera_zero3"}
    # same model, data and optimizer: the same loss to fp32 rounding
    assert abs(rows["fsdp2"]["final_loss"] - rows["tessera_zero3"]["final_loss"]) < 1e-3
    assert rows["tessera_zero3"]["comm_mib_per_step"]["reduce_scatter@dp"] > 0
    assert "zero3_tokens_per_s_vs_fsdp2" in result.headline
    paths = write_results(result, tmp_path, plot_train)
    assert json.loads(paths[0].read_text())["parameters"] > 0
