"""`tessera bench fdia --quick` end to end: every attack and detector has a row, the
headline figures exist, and the JSON, table and plot are written."""

import json
import math

from tessera.apps.sil_fdia.attacks import KINDS
from tessera.bench.fdia import plot_fdia, run_fdia_bench
from tessera.bench.harness import write_results


def test_quick_fdia_bench(tmp_path):
    result = run_fdia_bench(quick=True, progress=False)
    assert [row["attack"] for row in result.rows] == list(KINDS)
    for row in result.rows:
        for name in ("telemetry", "sound", "fused"):
            assert 0.0 <= row[f"auc_{name}"] <= 1.0
    assert set(result.headline) == {
        "fused_auc_scale_1_5x", "fused_auc_replay", "stealthy_auc_telemetry", "stealthy_auc_fused", "zap_f1_10db",
    }  # fmt: skip
    assert all(isinstance(v, float) and math.isfinite(v) for v in result.headline.values())
    paths = write_results(result, tmp_path, plot_fdia)
    payload = json.loads(paths[0].read_text())
    assert payload["zap_sweep"][1]["snr_db"] == 10.0
    assert "| attack |" in paths[1].read_text() and paths[2].stat().st_size > 10_000
