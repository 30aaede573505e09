"""`tessera bench fdia --quick` end to end: every attack and detector has a row, the
headline figures exist, and the JSON, table and plot are written."""

import dataclasses
import json
import math

from tessera.apps.sil_fdia.attacks import KINDS
from tessera.bench.fdia import QUICK, QUICK_SEEDS, plot_fdia, run_fdia_bench
from tessera.bench.harness import write_results

# smaller than --quick (every attack still has a scenario, every detector a score, the sweep
# its three SNRs): the numbers are not the point here, the rows and files are
TINY = dataclasses.replace(QUICK, num_lamps=2, scenarios_per_kind=1, listen_night_s=15.0, listen_day_s=5.0)
TINY_SWEEP = {"snrs": (5.0, 10.0, 20.0), "clips": 2, "seconds": 10.0}


def test_quick_fdia_bench(tmp_path):
    # two seeds: the smallest number with an interval
    result = run_fdia_bench(quick=True, progress=False, plan=TINY, sweep_plan=TINY_SWEEP, seeds=QUICK_SEEDS)
    assert [row["attack"] for row in result.rows] == list(KINDS)
    assert result.extra["seeds"] == list(QUICK_SEEDS) and not set(QUICK_SEEDS) & {0, 1, 2, 3}  # fresh seeds
    for row in result.rows:
        for name in ("telemetry", "sound", "fused"):
            lo, hi = row[f"auc_{name}_ci95"]
            # the mean lies in its interval (equal when both seeds agree), all within [0, 1]
            assert 0.0 <= lo <= row[f"auc_{name}"] <= hi <= 1.0
    for row in result.extra["false_alarms_per_attack"]:
        assert all(0.0 <= row[f"neighbours_{n}"] <= 1.0 for n in ("telemetry", "sound", "fused"))
    assert set(result.headline) == {
        "seeds", "fused_auc_scale_1_5x", "fused_auc_replay", "stealthy_auc_telemetry", "stealthy_auc_fused",
        "replay_audio_auc_sound", "replay_audio_auc_fused", "zap_f1_10db",
    }  # fmt: skip
    assert result.headline.pop("seeds") == 2
    assert all(isinstance(v, float) and math.isfinite(v) for v in result.headline.values())
    paths = write_results(result, tmp_path, plot_fdia)
    payload = json.loads(paths[0].read_text())
    assert payload["zap_sweep"][1]["snr_db"] == 10.0
    assert "| attack |" in paths[1].read_text() and paths[2].stat().st_size > 10_000
