"""`tessera bench overlap` end to end on a tiny config: every (stage, prefetch) row is
there, overlap leaves the losses unchanged and issues the same link time (the same
collectives of the same bytes: the emulated link time is a function of the bytes, so equal
up to the rows' rounding), and the results are written. The hidden fractions themselves are timings: the
benchmark reports them, no test asserts them."""

import dataclasses
import json

import pytest

from tessera.bench.harness import write_results
from tessera.bench.overlap import QUICK, plot_overlap, run_overlap_bench

TINY = dataclasses.replace(QUICK, n_embd=32, n_layer=2, vocab=128, seq=16, global_batch=4, steps=1)


def test_quick_overlap_bench(tmp_path):
    result = run_overlap_bench(quick=True, progress=False, cfg=TINY)
    assert [(r["stage"], r["prefetch"]) for r in result.rows] == [
        ("zero2", 0), ("zero2", 1), ("zero3", 0), ("zero3", 1),
    ]  # fmt: skip
    by = {(r["stage"], r["prefetch"]): r for r in result.rows}
    for stage in ("zero2", "zero3"):
        assert result.headline[f"{stage}_losses_equal"] is True
        # abs 2e-4: the rows round to 1e-4, and the same terms may be summed in another order
        assert by[(stage, 1)]["link_s_per_step"] == pytest.approx(by[(stage, 0)]["link_s_per_step"], abs=2e-4)
        assert by[(stage, 0)]["link_s_per_step"] > 0
        assert 0 <= result.headline[f"{stage}_hidden_prefetch1"] <= 1
    paths = write_results(result, tmp_path, plot_overlap)
    assert json.loads(paths[0].read_text())["link"]["scale"] < 1  # a CPU core is slower than the GPU
