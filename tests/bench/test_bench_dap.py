"""`tessera bench dap --quick` end to end: bytes equal the formula on 2 and 4 ranks and
the results are written."""

import json

from tessera.bench.dap import plot_dap, run_dap_bench
from tessera.bench.harness import write_results


def test_quick_dap_bench(tmp_path):
    result = run_dap_bench(quick=True, progress=False)
    assert [row["ranks"] for row in result.rows] == [1, 2, 4]
    assert result.headline["max_bytes_rel_error"] == 0.0  # the formula counts every byte
    assert all(row["bytes_per_block"] == row["formula_bytes_per_block"] for row in result.rows)
    paths = write_results(result, tmp_path, plot_dap)
    assert json.loads(paths[0].read_text())["rows"][2]["ranks"] == 4
