"""The baseline schedulers do what the systems they stand for do (TEI's FIFO under a padded
token budget, infinity-emb's sorted windows, one by one), and limits are validated."""

import pytest

from tessera.serve.choices import make_scheduler
from tessera.serve.request import Request
from tessera.serve.scheduler import BatchLimits, FifoPadded, OneByOne, SortWindow


def requests(lengths):
    return [Request([1] * n, arrival=float(i)) for i, n in enumerate(lengths)]


def test_fifo_padded_grows_in_arrival_order_within_the_padded_budget():
    limits = BatchLimits(max_batch_size=4, max_batch_tokens=100)
    queue = requests([10, 20, 30, 5, 5])
    batch = FifoPadded(limits).schedule(queue)
    assert batch == queue[:3]  # 30 x 3 = 90 fits; a 4th makes 30 x 4 = 120
    queue = requests([1] * 9)
    assert FifoPadded(limits).schedule(queue) == queue[:4]  # request limit
    queue = requests([90, 5])
    assert FifoPadded(limits).schedule(queue) == queue[:1]  # 90 x 2 > 100


def test_an_unpadded_budget_counts_the_sum_of_the_lengths():
    """As the unpadded runner computes a batch (and TEI's queue counts for unpadded backends)."""
    limits = BatchLimits(max_batch_size=4, max_batch_tokens=100, padded=False)
    assert limits.tokens([90, 5]) == 95 and BatchLimits(max_batch_tokens=100).tokens([90, 5]) == 180
    queue = requests([90, 5, 10])
    assert FifoPadded(limits).schedule(queue) == queue[:2]  # 95 fits, 105 does not (padded: 90 alone)
    window = SortWindow(BatchLimits(max_batch_size=4, max_batch_tokens=100, padded=False))
    assert len(window.schedule(requests([40, 40, 40, 40]))) == 2  # 80 fits, 120 does not


def test_an_engine_refuses_limits_that_count_tokens_unlike_its_runner():
    from tessera.serve.engine import Engine

    class Unpadded:
        padded = False

        def __call__(self, batch):
            return [[0.0] for _ in batch]

    with pytest.raises(ValueError, match=r"count padded tokens but the runner computes unpadded batches"):
        Engine(Unpadded(), FifoPadded(BatchLimits()))
    Engine(Unpadded(), FifoPadded(BatchLimits(padded=False)))


def test_sort_window_sorts_whole_windows_and_runs_them_in_turn():
    limits = BatchLimits(max_batch_size=2, max_batch_tokens=10_000)
    queue = requests([50, 10, 40, 20, 30])  # 5 // 2 = 2 windows of 2 -> the first 4 sorted
    scheduler = SortWindow(limits)
    first = scheduler.schedule(queue)
    assert [r.length for r in first] == [10, 20]
    rest = [r for r in queue if r not in first]
    second = scheduler.schedule(rest)
    assert [r.length for r in second] == [40, 50]  # the window's second batch, before the 30
    rest = [r for r in rest if r not in second]
    assert scheduler.schedule(rest) == rest  # a new window of the 30 alone


def test_sort_window_skips_requests_that_left_its_window():
    limits = BatchLimits(max_batch_size=2, max_batch_tokens=10_000)
    queue = requests([5, 6, 7, 8])
    scheduler = SortWindow(limits)
    scheduler.schedule(queue)
    still_waiting = [queue[3]]  # queue[2] was cancelled while its window waited
    assert scheduler.schedule(still_waiting) == [queue[3]]


def test_sort_window_keeps_batches_within_the_token_budget():
    limits = BatchLimits(max_batch_size=4, max_batch_tokens=100)
    queue = requests([40, 40, 40, 40])
    scheduler = SortWindow(limits)
    assert len(scheduler.schedule(queue)) == 2  # 40 x 3 = 120 > 100
    assert len(scheduler.schedule(queue[2:])) == 2


def test_one_by_one_and_validation():
    queue = requests([5, 6])
    assert OneByOne(BatchLimits()).schedule(queue) == queue[:1]
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer, got 0"):
        BatchLimits(max_batch_size=0)
    with pytest.raises(ValueError, match="unknown scheduler 'lifo'"):
        make_scheduler("lifo", BatchLimits())
    with pytest.raises(ValueError, match="needs a cost table"):
        make_scheduler("dp", BatchLimits())


def test_every_name_the_command_line_takes_builds_that_scheduler():
    """`tessera serve --scheduler` offers the names the factory builds (derived from the
    classes, not a second list): each builds a scheduler of that name, and an unknown one's
    error lists exactly them."""
    import argparse

    from tessera.serve.commands import add_serve_parser
    from tessera.serve.cost import CostTable
    from tessera.serve.scheduler import NAMES

    sub = argparse.ArgumentParser().add_subparsers()
    add_serve_parser(sub, int)
    serve = sub.choices["serve"]
    offered = next(a.choices for a in serve._actions if a.dest == "scheduler")
    assert tuple(offered) == NAMES
    table = CostTable([8, 16], [1, 2], [[1.0, 1.5], [2.0, 3.0]])
    for name in offered:
        assert make_scheduler(name, BatchLimits(), table).name == name
    with pytest.raises(ValueError, match=f"choose one of {', '.join(NAMES)}$"):
        make_scheduler("lifo", BatchLimits())
