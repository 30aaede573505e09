"""TurboTransformers' DP scheduler: optimal over all partitions (brute force, n <= 8),
never worse than one-by-one, pad-everything or the baselines' batches under the same
cost table, fast enough to plan a 256-request queue, and scheduling the oldest first."""

import dataclasses
import random
import time

import pytest

from tessera.serve.cost import CostTable
from tessera.serve.dp_scheduler import DPScheduler, plan_batches
from tessera.serve.request import Request
from tessera.serve.scheduler import BatchLimits, FifoPadded, SortWindow


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield partition[:i] + [[first, *partition[i]]] + partition[i + 1 :]


def partition_cost(batches, lengths, table: CostTable, limits: BatchLimits) -> float:
    total = 0.0
    for batch in batches:
        if not limits.fits([lengths[i] for i in batch]):
            return float("inf")
        total += table.cost(max(lengths[i] for i in batch), len(batch))
    return total


def random_table(rng: random.Random) -> CostTable:
    """Launch overhead + dense work per token + attention per token x length, with noise:
    the shapes a measured CPU table has (made monotone by CostTable)."""
    overhead, dense, attention = rng.uniform(0, 5e-3), rng.uniform(1e-5, 1e-4), rng.uniform(0, 1e-7)
    discount = rng.uniform(0.3, 1.0)  # how much batching saves per extra request

    def cost(n, b):
        noise = rng.uniform(0.9, 1.1)
        return noise * (overhead + (1 + discount * (b - 1)) * (dense * n + attention * n * n))

    return CostTable.from_function(cost, [1, 4, 8, 16, 32, 64], [1, 2, 3, 4, 6, 8])


def random_case(rng, n, *, padded=True):
    """A random cost table, n sorted lengths, random limits, and the DP's plan of them."""
    table = random_table(rng)
    lengths = sorted(rng.randint(1, 64) for _ in range(n))
    limits = BatchLimits(
        max_batch_size=rng.randint(1, 8), max_batch_tokens=rng.randint(64, 300), padded=padded
    )
    runs, total = plan_batches(lengths, table.dense(64, limits.max_batch_size), limits)
    return table, lengths, limits, [list(range(a, b)) for a, b in runs], total


def test_dp_equals_brute_force_over_all_partitions():
    rng = random.Random(0)
    cases = 0
    for trial in range(120):
        n = 1 + trial % 8
        table, lengths, limits, batches, total = random_case(rng, n)
        assert [i for batch in batches for i in batch] == list(range(n))  # contiguous runs, in order
        # rel=1e-12: <= 8 float64 costs summed in another order (rounding ~1e-16 each)
        assert partition_cost(batches, lengths, table, limits) == pytest.approx(total, rel=1e-12)
        brute = min(partition_cost(p, lengths, table, limits) for p in set_partitions(list(range(n))))
        # The same table lookups summed in another order: equal up to float rounding.
        assert total == pytest.approx(brute, rel=1e-12), (lengths, limits)
        cases += n == 8
    assert cases >= 10


def runs_of(n):
    """Every cut of range(n) into consecutive runs."""
    for mask in range(1 << max(0, n - 1)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        yield [list(range(a, b)) for a, b in zip(cuts, cuts[1:], strict=False)]


def test_under_an_unpadded_budget_the_dp_is_the_best_cut_into_runs():
    """An unpadded runner's budget counts the sum of the lengths: the DP keeps every batch
    within it and is the cheapest cut of the sorted queue into runs (brute force over all
    2^(n-1) cuts); whether a non-contiguous partition could be cheaper is not claimed
    (dp_scheduler's doc)."""
    rng = random.Random(1)
    binding = 0
    for trial in range(120):
        n = 1 + trial % 9
        table, lengths, limits, batches, total = random_case(rng, n, padded=False)
        assert all(sum(lengths[i] for i in b) <= limits.max_batch_tokens for b in batches)
        best = min(partition_cost(p, lengths, table, limits) for p in runs_of(n))
        assert total == pytest.approx(best, rel=1e-12), (lengths, limits)  # same lookups, other order
        padded = dataclasses.replace(limits, padded=True)
        binding += partition_cost(batches, lengths, table, padded) == float("inf")  # over a padded budget
    assert binding >= 5  # the sum budget admitted batches a padded count would refuse


def requests(lengths):
    return [Request([1] * n, arrival=float(i)) for i, n in enumerate(lengths)]


def plan_cost(scheduler, queue, table, limits) -> float:
    """Cost of the batches a scheduler makes when it drains ``queue``."""
    waiting, total = list(queue), 0.0
    while waiting:
        batch = scheduler.schedule(waiting)
        total += table.cost(max(r.length for r in batch), len(batch))
        waiting = [r for r in waiting if r not in batch]
    return total


def test_never_worse_than_one_by_one_pad_everything_or_baselines():
    rng = random.Random(1)
    limits = BatchLimits(max_batch_size=32, max_batch_tokens=4096)
    for _ in range(30):
        table = random_table(rng)
        queue = requests([rng.randint(1, 64) for _ in range(rng.randint(1, 96))])
        dp = DPScheduler(limits, table)
        _, total = dp.plan(queue)
        one_by_one = sum(table.cost(r.length, 1) for r in queue)
        # (1 + 1e-12) here and below: float64 sums of <= 96 costs in another order, rounding only
        assert total <= one_by_one * (1 + 1e-12)
        longest = max(r.length for r in queue)
        if limits.fits([r.length for r in queue]):
            assert total <= table.cost(longest, len(queue)) * (1 + 1e-12)  # rounding, as above
        for baseline in (FifoPadded(limits), SortWindow(limits)):
            assert total <= plan_cost(baseline, queue, table, limits) * (1 + 1e-12)  # as above
        # Scheduling batch by batch (oldest first, re-planning) costs what the plan said: the
        # same costs summed batch by batch, float64 rounding over <= 96 terms (rel 1e-9).
        assert plan_cost(DPScheduler(limits, table), queue, table, limits) == pytest.approx(total, rel=1e-9)


def test_schedules_the_batch_holding_the_oldest_request():
    table = CostTable.from_function(lambda n, b: 1e-3 + 1e-5 * n * b, [1, 512], [1, 32])
    limits = BatchLimits(max_batch_size=4, max_batch_tokens=2048)
    queue = requests([300, 5, 6, 7, 8, 9, 310, 320])  # the oldest is the 300-token one
    batch = DPScheduler(limits, table).schedule(queue)
    assert queue[0] in batch
    assert all(r.length >= 300 for r in batch)  # batched with its length neighbours


def test_plans_256_requests_with_at_most_max_batch_candidates_each():
    """The plan's work is bounded by the limits, not the queue: each request weighs at most
    ``max_batch_size`` candidate batches (cells of the dense table), so planning 256 requests
    stays cheap on any machine (its time is printed, not asserted: no wall-clock test)."""
    table = CostTable.from_function(
        lambda n, b: 2e-3 + 4e-5 * n * (1 + 0.8 * (b - 1)),
        [8, 32, 64, 128, 256, 384, 512],
        [1, 2, 4, 8, 16, 32],
    )
    limits = BatchLimits(max_batch_size=32, max_batch_tokens=16384)
    rng = random.Random(2)
    queue = requests([rng.randint(5, 500) for _ in range(256)])
    scheduler = DPScheduler(limits, table)
    reads = 0

    class Row(list):  # counts the cells the plan reads
        def __getitem__(self, b):
            nonlocal reads
            reads += 1
            return super().__getitem__(b)

    rows = [Row(r) for r in table.dense(500, limits.max_batch_size)]
    ordered = sorted(queue, key=lambda r: r.length)
    runs, _ = plan_batches([r.length for r in ordered], rows, limits)
    assert 0 < reads <= len(queue) * limits.max_batch_size
    assert [i for a, b in runs for i in range(a, b)] == list(range(len(queue)))  # each once, in order
    scheduler.plan(queue)  # dense table built once, as at server start
    began = time.perf_counter()
    batches, _ = scheduler.plan(queue)
    print(f"DP plan of 256 requests: {(time.perf_counter() - began) / len(queue) * 1e6:.1f} us per request")
    assert sorted(r.id for b in batches for r in b) == sorted(r.id for r in queue)


def test_cost_table_is_monotone_interpolates_and_skips_cells_over_the_budget():
    table = CostTable([8, 16], [1, 2], [[2.0, 1.0], [1.5, 3.0]])  # noisy: not monotone as given
    assert table.seconds == [[2.0, 2.0], [2.0, 3.0]]
    # approx's default 1e-6 relative: 2.5 is a linear interpolation, exact but for float rounding
    assert table.cost(12, 2) == pytest.approx(2.5) and table.cost(8, 1) == 2.0
    rows = table.dense(16, 2)
    assert rows[16][2] == 3.0 and rows[12][2] == pytest.approx(2.5) and rows[5][1] == 2.0  # as above

    shapes = []
    measured = CostTable.measure(
        lambda seqs: shapes.append((len(seqs[0]), len(seqs))),
        max_length=64,
        max_batch_size=8,
        max_batch_tokens=128,
        lengths=[8, 32, 64],
        batch_sizes=[1, 4, 8],
        linear_ratio=float("inf"),  # measure every cell within the budget
    )
    assert all(n * b <= 128 for n, b in shapes)  # never runs a batch over the budget
    assert (64, 4) not in shapes and (32, 4) in shapes
    assert measured.measured == len({s for s in shapes[1:]})
    assert len(measured.seconds) == 3 and all(len(r) == 3 for r in measured.seconds)
