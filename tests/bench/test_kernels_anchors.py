"""The anchors of `tessera bench kernels`: every anchor that can run here computes the right
product and reports the code path it ran; one that cannot is said absent with the reason."""

import ctypes.util
import importlib.util

import numpy as np
import pytest

from tessera.bench import kernels_anchors as ka
from tessera.bench.kernels import KernelsPlan, _conv_shape, _median_seconds
from tessera.kernels import blas_libs, tvm_anchor


def _gamma(n: int) -> float:
    u = 2.0**-24
    return n * u / (1 - n * u)


def test_blas_anchors_compute_sgemm():
    """Each BLAS library present, on odd sizes (M = 1 is a matrix-vector product)."""
    rng = np.random.default_rng(0)
    for name, lib in ka.AnchorSet().blas.items():
        for m, n, k in ((1, 33, 71), (13, 17, 129)):
            a, b = (
                rng.standard_normal((m, k), dtype=np.float32),
                rng.standard_normal((k, n), dtype=np.float32),
            )
            c = np.full((m, n), np.nan, np.float32)
            lib.prepare(a, b, c)()
            exact = a.astype(np.float64) @ b.astype(np.float64)
            # a float32 sum of k products: |error| <= gamma(2k) * sum |a_i b_i| (any summation order)
            bound = _gamma(2 * k) * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))
            assert np.all(np.abs(c - exact) <= bound), (name, m, n, k)
    # the kernel set chosen is the one that ran (a library that ignores its override would not say so)
    for name, lib in ka.AnchorSet().blas.items():
        forced = lib.code_path["forced"]
        ran = lib.code_path["corename" if name == "openblas" else "arch"]
        assert forced is None or ran.lower() in forced.lower(), (name, forced, ran)


def test_every_present_anchor_reports_its_code_path():
    anchor_set = ka.AnchorSet()
    rows, specs = [], {}
    cases = (("gemm", (5, 48, 40), 2.0 * 5 * 48 * 40), ("conv", _conv_shape((8, 16, 6, 3, 1, 1), 1), None))
    for kind, spec, flops in cases:
        flops = flops or float(spec.flops)
        row = {"kind": kind, "shape": kind, "threads": 1, "gflops": 1.0, "flops": flops}
        row |= anchor_set.measure(kind, spec, 1, flops, _median_seconds, 3)
        specs[len(rows)] = spec
        rows.append(row)
    report = ka.attach_code_paths(rows, specs, anchor_set)
    assert "error" not in report["torch"], report["torch"]
    assert report["torch"]["mkl"] and report["torch"]["onednn_isa"] and report["torch"]["cpu_capability"]
    for row in rows:
        measured = [k.removesuffix("_gflops") for k in row if k.endswith("_gflops") and k != "numpy_gflops"]
        assert "torch" in measured and row["torch_path"] in (
            "mkl",
            "mkl_packed",
            "onednn",
            "default",
            "onednn_packed",
        )
        for name in measured:
            assert row["paths"].get(name) not in (None, "", "unknown"), (row["kind"], name, row["paths"])
        ka.best_anchor(row)
        assert row["best_anchor"] in ka.ANCHORS and row["best_anchor_path"]
    # the paths named are the ones the verbose logs show: MKL's SGEMM for torch.mm, a oneDNN
    # primitive for the oneDNN paths, torch's im2col or oneDNN for the default conv
    gemm, conv = rows
    assert gemm["paths"]["torch_mkl"].startswith("MKL SGEMM")
    assert gemm["paths"]["torch_onednn"].startswith("inner_product:")
    assert conv["paths"]["torch_onednn_packed"].startswith("convolution:")
    for name, rep in report["libraries"].items():
        assert rep["corename" if name == "openblas" else "arch"], rep
        # threadpoolctl finds a BLAS by its file name: the blis wheel's copy lives inside a
        # Python extension module, where it cannot
        assert rep["threadpoolctl"] is not None or "wheel" in rep["library"], (
            f"threadpoolctl does not see {name}"
        )


def test_missing_anchors_are_said_absent_with_the_reason(monkeypatch):
    real_find_spec = importlib.util.find_spec
    hidden = {"scipy_openblas32", "scipy_openblas64", "blis", "aoclda", "tvm"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in hidden else real_find_spec(n, *a)
    )
    monkeypatch.setattr(blas_libs, "_BLIS_SYSTEM", ("/nonexistent/libblis.so.4",))
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    anchor_set = ka.AnchorSet()
    assert set(anchor_set.absent) == {"openblas", "blis", "aocl_blis"}
    assert "scipy-openblas" in anchor_set.absent["openblas"] and ".[anchors]" in anchor_set.absent["openblas"]
    assert "apt-get install libblis4-openmp" in anchor_set.absent["blis"]
    assert "aoclda" in anchor_set.absent["aocl_blis"]
    assert "not installed" in tvm_anchor.tvm_status()
    row = {"kind": "gemm", "shape": "g", "threads": 1, "gflops": 1.0, "flops": 2.0 * 4 * 8 * 8}
    row |= anchor_set.measure("gemm", (4, 8, 8), 1, row["flops"], _median_seconds, 3)
    assert not any(f"{name}_gflops" in row for name in ka.BLAS) and row["torch_gflops"] > 0
    ka.best_anchor(row)
    h = ka.anchor_headline([row], anchor_set.absent, {})
    assert h["anchors_absent"] == anchor_set.absent and h["best_anchor_counts"] == {"torch": 1}


def test_bad_anchor_settings_are_refused():
    with pytest.raises(ValueError, match="tvm_trials=0"):
        KernelsPlan(tvm_trials=0)
    with pytest.raises(ValueError, match="M, N, K = 0, 8, 8"):
        KernelsPlan(gemm_shapes=(("empty", 0, 8, 8),))
    with pytest.raises(ValueError, match="unknown BLAS anchor 'mkl'"):
        blas_libs.load("mkl")
    if "blis" not in ka.AnchorSet().absent:
        with pytest.raises(ValueError, match="kernel set 'nosuch'"):
            blas_libs.blis("nosuch")


def test_tvm_curve_and_the_time_it_matches_tessera():
    # a curve as MetaSchedule's measure callback records it: best time so far after each batch
    flops = 2.0 * 64**3
    curve = [
        {"trials": 64, "tuning_s": 30.0, "best_s": None},  # nothing ran correctly yet
        {"trials": 128, "tuning_s": 61.0, "best_s": flops / 50e9},
        {"trials": 192, "tuning_s": 95.0, "best_s": flops / 120e9},
    ]
    row = {"shape": "64^3", "flops": flops, "gflops": 100.0, "tvm_curve": curve}
    assert ka.tvm_match_time(row) == 95.0  # the first batch at >= Tessera's 100 GFLOP/s
    assert ka.tvm_match_time({**row, "gflops": 121.0}) is None  # never within the budget
    table = ka.tvm_curve_rows([row])
    assert [p["tvm_best_gflops"] for p in table] == [None, 50.0, 120.0]


def test_tvm_trials_flag(monkeypatch, capsys):
    """``--tvm-trials 0`` leaves TVM out of the run (no TVM shapes), N sets its budget, and a
    negative count is a one-line usage error."""
    import tessera.bench.kernels as bench_kernels
    from tessera.cli import main

    plans = []

    def capture(plan):
        plans.append(plan)
        raise KeyboardInterrupt  # stop before anything runs

    monkeypatch.setattr(bench_kernels, "run_kernels_bench", capture)
    assert main(["bench", "kernels", "--tvm-trials", "0"]) == 130
    assert main(["bench", "kernels", "--tvm-trials", "64"]) == 130
    assert (plans[0].tvm_gemms, plans[0].tvm_convs) == ((), ())
    assert plans[1].tvm_trials == 64 and plans[1].tvm_gemms
    with pytest.raises(SystemExit):
        main(["bench", "kernels", "--tvm-trials", "-1"])
    assert "expected an integer >= 0, got -1" in capsys.readouterr().err


@pytest.mark.skipif(
    tvm_anchor.tvm_status() is not None, reason="apache-tvm not installed (extra tessera[tvm])"
)
def test_a_finished_tvm_tuning_is_kept_and_reused(tmp_path):
    """The second run builds TVM's best from the kept database, times it, and says so; the
    tuning's curve and time are the first run's."""
    first = tvm_anchor.tvm_measure("gemm", (16, 16, 16), 1, 2, repeats=3, cache=str(tmp_path))
    assert "error" not in first, first
    assert first["tuning_reused"] is False and first["measured_trials"] >= 1
    kept = list(tmp_path.iterdir())
    assert [p.name for p in kept] == [tvm_anchor.cache_key("gemm", (16, 16, 16), 1, 2)]  # no temporary left
    again = tvm_anchor.tvm_measure("gemm", (16, 16, 16), 1, 2, repeats=3, cache=str(tmp_path))
    assert again["tuning_reused"] is True and again["tuned_at"] is not None
    assert again["curve"] == first["curve"] and again["tuning_s"] == first["tuning_s"]
    assert again["seconds"] > 0
    # another trial budget is another tuning
    assert tvm_anchor.cache_key("gemm", (16, 16, 16), 1, 3) != kept[0].name


def test_timing_rounds_are_combined_by_median_and_scored_round_by_round():
    # three rounds of one case: Tessera 10, 30, 20; OpenBLAS 20, 20, 40; torch's paths (mkl,
    # onednn) best at onednn in the medians even where mkl wins a round
    rounds = [
        {
            "gflops": 10.0,
            "seconds": 3.0,
            "openblas_gflops": 20.0,
            "torch_mkl_gflops": 9.0,
            "torch_onednn_gflops": 8.0,
            "torch_path": "mkl",
            "torch_gflops": 9.0,
        },
        {
            "gflops": 30.0,
            "seconds": 1.0,
            "openblas_gflops": 20.0,
            "torch_mkl_gflops": 1.0,
            "torch_onednn_gflops": 5.0,
            "torch_path": "onednn",
            "torch_gflops": 5.0,
        },
        {
            "gflops": 20.0,
            "seconds": 2.0,
            "openblas_gflops": 40.0,
            "torch_mkl_gflops": 2.0,
            "torch_onednn_gflops": 6.0,
            "torch_path": "onednn",
            "torch_gflops": 6.0,
        },
    ]
    row = {"kind": "gemm", "shape": "g", "threads": 1, **ka.median_of_rounds(rounds)}
    assert (row["gflops"], row["seconds"], row["openblas_gflops"]) == (20.0, 2.0, 20.0)
    assert (row["torch_path"], row["torch_gflops"]) == ("onednn", 6.0)
    assert [r["torch_gflops"] for r in row["rounds"]] == [9.0, 5.0, 6.0]
    # round by round: 10/20 (loss), 30/20 (win), 20/40 (loss); the medians: 20/20 (win)
    h = ka.rounds_headline([row])
    assert h["win_fraction_rounds"] == [0.0, 1.0, 0.0] and h["win_fraction_range"] == [0.0, 1.0]
    assert h["geomean_rounds"] == [0.5, 1.5, 0.5]
    ka.best_anchor(row)
    assert row["win"] and row["vs_best_anchor"] == 1.0
