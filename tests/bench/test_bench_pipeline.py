"""`tessera bench pipeline --quick` runs end to end and says what it measured."""

from tessera.bench.pipeline import run_pipeline_bench


def test_pipeline_bench_quick_measures_every_schedule_and_sequence_lengths():
    result = run_pipeline_bench(quick=True)
    assert [r["schedule"] for r in result.rows] == ["gpipe", "1f1b", "interleaved (v=2)"]
    for row in result.rows:
        assert row["step_s"] > 0 and row["bubble_measured"] < 1 and row["peak_mib_stage0"] > 0
    # the formula for p = 2 stages and m = 4 micro-batches: 1/5, interleaved with v = 2: 1/9
    assert [r["bubble_formula"] for r in result.rows] == [0.2, 0.2, 0.111]
    one, two = result.extra["sp_one_rank"]["longest"], result.extra["sp_two_ranks"]["longest"]
    assert one and two and two > one  # half the sequence per rank fits a longer one
