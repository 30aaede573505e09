"""The engine without HTTP or a model (a fake runner that records what it ran): answers
go to the right requests exactly once, cancelled waiting requests never run, a full
queue refuses whole calls, draining refuses new work and finishes accepted work, and a
failing batch fails only its own requests."""

import random
import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch

from tessera.serve.cost import CostTable
from tessera.serve.dp_scheduler import DPScheduler
from tessera.serve.engine import Engine
from tessera.serve.request import DrainingError, QueueFullError
from tessera.serve.scheduler import BatchLimits, FifoPadded, SortWindow


class FakeRunner:
    """Row i of the output is (first token, length) of input i; records every batch."""

    padded = False

    def __init__(self, delay: float = 0.0, fail_on: int | None = None):
        self.batches: list[list[list[int]]] = []
        self.delay, self.fail_on = delay, fail_on

    def __call__(self, sequences):
        self.batches.append(sequences)
        if self.delay:
            time.sleep(self.delay)
        if self.fail_on is not None and any(s[0] == self.fail_on for s in sequences):
            raise RuntimeError("boom")
        return torch.tensor([[float(s[0]), float(len(s))] for s in sequences])

    def seen(self) -> list[int]:
        return [s[0] for batch in self.batches for s in batch]


def seqs(lengths, start=0):
    return [[start + i] * n for i, n in enumerate(lengths)]


LIMITS = BatchLimits(max_batch_size=4, max_batch_tokens=64, padded=False)  # as FakeRunner computes
TABLE = CostTable.from_function(lambda n, b: 1e-3 + 1e-5 * n * b, [1, 64], [1, 4])


@pytest.mark.parametrize("scheduler", [FifoPadded(LIMITS), SortWindow(LIMITS), DPScheduler(LIMITS, TABLE)])
def test_each_answer_reaches_its_own_request_once(scheduler):
    runner = FakeRunner()
    engine = Engine(runner, scheduler, max_queue=64)
    rng = random.Random(0)
    reqs = engine.submit(seqs([rng.randint(1, 16) for _ in range(20)]))
    while engine.step():
        pass
    for i, r in enumerate(reqs):
        assert r.future.result().tolist() == [float(i), float(r.length)]
    assert sorted(runner.seen()) == list(range(20))  # each computed once
    assert engine.counts["completed"] == 20 and not engine.waiting


def test_cancelled_waiting_requests_never_reach_the_runner():
    runner = FakeRunner()
    engine = Engine(runner, FifoPadded(LIMITS))
    reqs = engine.submit(seqs([4] * 6))
    assert engine.cancel([reqs[1], reqs[4]]) == 2
    while engine.step():
        pass
    assert sorted(runner.seen()) == [0, 2, 3, 5]
    assert reqs[1].future.cancelled() and reqs[1].cancelled
    with pytest.raises(CancelledError):
        reqs[4].future.result()
    assert engine.counts["cancelled"] == 2


def test_a_full_queue_refuses_the_whole_call_with_a_retry_estimate():
    engine = Engine(FakeRunner(), FifoPadded(LIMITS), max_queue=5)
    engine.submit(seqs([2] * 3))
    with pytest.raises(QueueFullError) as raised:
        engine.submit(seqs([2] * 3))
    assert raised.value.retry_after_s > 0
    assert engine.queue_size() == 3  # none of the refused call was queued
    engine.submit(seqs([2] * 2))
    assert engine.counts == {**engine.counts, "accepted": 5, "rejected": 3}
    with pytest.raises(ValueError, match="input 0 has 65 tokens"):
        engine.submit(seqs([65]))


def test_drain_finishes_accepted_work_and_refuses_new():
    runner = FakeRunner(delay=0.01)
    engine = Engine(runner, FifoPadded(LIMITS)).start()
    reqs = engine.submit(seqs([3] * 12))
    engine.begin_drain()
    with pytest.raises(DrainingError):
        engine.submit(seqs([3]))
    assert engine.stop(timeout=10)
    assert all(r.future.done() and not r.future.cancelled() for r in reqs)
    assert sorted(runner.seen()) == list(range(12))


def test_a_failing_batch_fails_its_requests_and_the_engine_goes_on():
    runner = FakeRunner(fail_on=1)
    engine = Engine(runner, FifoPadded(BatchLimits(max_batch_size=1, max_batch_tokens=64, padded=False)))
    reqs = engine.submit(seqs([2, 2, 2]))
    while engine.step():
        pass
    assert reqs[0].future.result().tolist() == [0.0, 2.0]
    with pytest.raises(RuntimeError, match="boom"):
        reqs[1].future.result()
    assert reqs[2].future.result().tolist() == [2.0, 2.0]


def test_concurrent_submit_and_cancel_lose_nothing_and_answer_nothing_twice():
    runner = FakeRunner(delay=0.002)
    engine = Engine(runner, DPScheduler(LIMITS, TABLE), max_queue=40).start()
    accepted, refused, lock = [], [0], threading.Lock()

    def client(seed):
        rng = random.Random(seed)
        for k in range(30):
            try:
                mine = engine.submit(seqs([rng.randint(1, 16)], start=seed * 1000 + k))
            except QueueFullError:
                with lock:
                    refused[0] += 1
                continue
            if rng.random() < 0.2:
                engine.cancel(mine)
            with lock:
                accepted.extend(mine)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.stop(timeout=30)
    seen = runner.seen()
    assert len(seen) == len(set(seen))  # nothing computed twice
    computed = set(seen)
    for r in accepted:
        assert r.future.done()
        if r.future.cancelled():
            assert r.tokens[0] not in computed  # dropped before compute
        else:
            assert r.future.result()[0].item() == r.tokens[0] and r.tokens[0] in computed
    assert len(accepted) + refused[0] == 6 * 30
    assert engine.counts["completed"] + engine.counts["cancelled"] == len(accepted)


def test_two_workers_share_the_queue_and_answer_each_request_once():
    """Workers take batches as they free up: with a batch taking 20 ms, both run batches at
    once; every request is computed by one of them, exactly once, its answer its own."""
    first, second = FakeRunner(delay=0.02), FakeRunner(delay=0.02)
    engine = Engine(first, FifoPadded(LIMITS), max_queue=64, workers=[second]).start()
    reqs = engine.submit(seqs([3] * 24))
    assert engine.stop(timeout=10)
    for i, r in enumerate(reqs):
        assert r.future.result().tolist() == [float(i), 3.0]
    assert sorted(first.seen() + second.seen()) == list(range(24))
    assert first.batches and second.batches  # both took work
    padded = FakeRunner()
    padded.padded = True
    with pytest.raises(ValueError, match="every worker's runner must compute batches the way the first does"):
        Engine(FakeRunner(), FifoPadded(LIMITS), workers=[padded])
