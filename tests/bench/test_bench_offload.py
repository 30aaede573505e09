"""`tessera bench offload` pieces: one trial per Tessera variant in this process (a tiny
GPT-2 that trains, its resident peaks and, offloaded, its moved bytes measured), and the
result (headline ratios, tables, plot) from a ladder's rows."""

import json

from tessera.bench.harness import write_results
from tessera.bench.offload import OffloadBenchConfig, plot_offload, trial
from tessera.bench.offload_report import result as _result

TINY = OffloadBenchConfig(
    budget_mib=4000,
    width=32,
    heads=4,
    vocab=128,
    seq=16,
    depths=(1, 2),
    common_depth=1,
    steps=2,
    chunk_mib=0.02,
)


def test_trials_measure_peak_throughput_and_moves():
    rows = {v: trial(TINY, 2, v) for v in ("none", "static", "tessera")}
    for v, row in rows.items():
        assert 0 < row["peak_mib"] < 4000 and row["tokens_per_s"] > 0, (v, row)
    assert rows["none"]["moved_mib_per_step"] is None
    # the host budget left for chunks is far above this model: offload reads back what
    # static offload evicts after every use, the planned placement keeps it in memory
    assert rows["static"]["moved_mib_per_step"] > 0
    assert rows["tessera"]["moved_mib_per_step"] < rows["static"]["moved_mib_per_step"]
    assert abs(rows["static"]["loss"] - rows["tessera"]["loss"]) == 0  # same arithmetic


def test_result_headline_and_files(tmp_path):
    def row(variant, depth, ok, tps=10.0, moved=1.0):
        return dict(variant=variant, depth=depth, params_m=depth * 1.0, ok=ok, peak_mib=100.0 * depth,
                    tokens_per_s=tps, moved_mib_per_step=moved)  # fmt: skip

    rows = [row("none", 1, True, 20.0, None), row("none", 2, False),
            row("static", 1, True, 8.0, 30.0), row("static", 2, True), row("tessera", 1, True, 18.0, 6.0),
            row("tessera", 2, True)]  # fmt: skip
    result = _result(TINY, rows, {"none": 1, "static": 2, "tessera": 2}, ["none", "static", "tessera"])
    h = result.headline
    assert h["moved_vs_static"] == 0.2 and h["tokens_per_s_vs_no_offload"] == 0.9
    assert h["largest_vs_static"] == 1.0 and h["lower_bound"]["tessera"]
    paths = write_results(result, tmp_path, plot_offload)
    assert json.loads(paths[0].read_text())["headline"]["budget_mib"] == 4000
    assert any("top of the ladder" in n for n in result.notes)  # a lower bound, said so
