"""The DiT benchmark's machinery on a toy plan: every layout runs, bytes match the
formulas exactly, exact layouts reproduce serial, and JSON + markdown + PNG are written."""

import json

from tessera.bench.dit import LAYOUTS, DitBenchPlan, plot_dit, run_dit_bench
from tessera.bench.harness import write_results


def test_toy_bench_writes_consistent_results(tmp_path):
    result = run_dit_bench(DitBenchPlan(sizes=(8,), steps=2), digits_model=None, progress=False)
    assert [r["method"] for r in result.rows] == list(LAYOUTS)
    assert result.headline["max_bytes_rel_error"] == 0.0  # the formulas count every byte
    for row in result.rows:
        if row["method"] in ("ulysses", "ring", "tensor_parallel", "cfg_parallel"):
            assert row["rel_diff_vs_serial"] < 1e-5, row  # exact methods: float32 rounding only
    paths = write_results(result, tmp_path, plot_dit)
    payload = json.loads(paths[0].read_text())
    assert {"headline", "machine", "rows"} <= set(payload) and payload["machine"]["cores"] >= 1
    assert "| pipefusion | 8x8 |" in paths[1].read_text()
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
