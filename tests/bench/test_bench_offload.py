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


def test_ladder_bisects_between_the_last_fit_and_the_first_miss(monkeypatch):
    """The ladder climbs to its first miss, then bisects: with depths (1, 2, 4, 8) and a
    model that fits up to depth 5, the largest found is 5 (not the ladder's 4), after trying
    6 and 5 between 4 and 8; every trial is a row."""
    from tessera.bench import offload

    tried = []

    def fake(cfg, depth, variant):
        tried.append(depth)
        return {"ok": depth <= 5, "peak_mib": 100.0 * depth}

    monkeypatch.setattr(offload, "_run_trial", fake)
    rows = []
    cfg = OffloadBenchConfig(depths=(1, 2, 4, 8))
    assert offload._ladder(cfg, "tessera", rows, progress=False) == 5
    assert tried == [1, 2, 4, 8, 6, 5]
    assert [r["depth"] for r in rows if r.get("bisect")] == [6, 5]
    rows.clear()
    monkeypatch.setattr(offload, "_run_trial", lambda cfg, depth, variant: {"ok": False})
    assert offload._ladder(cfg, "none", rows, progress=False) is None  # not even the first
    assert [r["depth"] for r in rows] == [1]


def test_hard_limit_kills_a_child_over_it():
    """The budget as a hard limit (a cgroup of the trial's own): a child that allocates 300 MiB
    is killed under a 200 MiB limit and said to be, and lives under a 600 MiB one. Machines
    where no cgroup can be made (no root, read-only cgroup fs) say why and are skipped here."""
    import subprocess
    import sys

    import pytest

    from tessera.bench.memory_limit import HardLimit

    code = "import numpy as np; a = np.ones(300 * 2**20 // 8); print(a.sum())"
    with HardLimit(200 * 2**20) as limit:
        if not limit.applied:
            pytest.skip(limit.how)
        out = subprocess.run([sys.executable, "-c", code], preexec_fn=limit.preexec, capture_output=True)
        assert limit.killed(out.returncode), (out.returncode, limit.how)
    with HardLimit(600 * 2**20) as limit:
        out = subprocess.run([sys.executable, "-c", code], preexec_fn=limit.preexec, capture_output=True)
        assert out.returncode == 0 and not limit.killed(out.returncode)
        assert limit.peak_bytes() >= 300 * 2**20  # the array's pages were charged to the group
