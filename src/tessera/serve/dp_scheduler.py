"""TurboTransformers' batch scheduler (Fang et al., PPoPP 2021, section 5, Algorithm 2):
sort the waiting requests by length and cut the sorted list into contiguous batches by
dynamic programming, minimising the summed batch latency cost(longest, size) from the
table measured at start-up, under the token budget and the batch-size limit.

Why contiguous is enough: a batch costs cost(its longest input, its size), non-decreasing
in the longest input. Take any partition and two batches A, B with max(A) <= max(B) where
B holds some x shorter than some y in A: swapping x and y leaves both sizes, does not raise
max(A) (y left it, x < y came in) and keeps max(B) (y <= max(A) <= max(B)); the padded
token count size x longest cannot rise either. Repeating the swap reaches a partition into
runs of the sorted order that costs no more. So the best partition of the sorted list into
runs is the best of all partitions (the test checks it against brute force).

The recurrence: best[i] = min over b of best[i - b] + cost(len[i], b), where the run ending
at the i-th shortest request holds b requests, b <= max_batch_size, and its tokens as the
runner computes them within the token budget (padded: b x len[i]; unpadded: the run's sum).
O(n x max_batch_size) lookups in a dense table.

Under an unpadded runner's budget (the sum of the lengths) the swap above can raise B's sum
past the budget, so the argument no longer covers the budget: the DP is then the best cut
into runs of the sorted order (the test checks that against brute force over runs), not
proved the best of all partitions. Where the budget does not bind (the defaults: 32 inputs
of at most 512 tokens in 16,384), the two are the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.serve.cost import CostTable
from tessera.serve.request import Request
from tessera.serve.scheduler import DP, BatchLimits, Scheduler


def plan_batches(
    lengths: Sequence[int], rows: list[list[float]], limits: BatchLimits
) -> tuple[list[tuple[int, int]], float]:
    """The optimal cut of ``lengths`` (sorted, non-decreasing) into runs ``[start, end)``,
    and its total cost; ``rows[length][size]`` is the batch latency."""
    n = len(lengths)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    prefix = [0]
    for length in lengths:
        prefix.append(prefix[-1] + length)
    for i in range(1, n + 1):
        longest = lengths[i - 1]
        row = rows[longest]
        top = min(limits.max_batch_size, i)
        if limits.padded:
            top = min(top, limits.max_batch_tokens // longest)
        value, start = best[i - 1] + row[1], i - 1
        for b in range(2, top + 1):
            if not limits.padded and prefix[i] - prefix[i - b] > limits.max_batch_tokens:
                break  # longer runs only add tokens
            candidate = best[i - b] + row[b]
            if candidate < value:
                value, start = candidate, i - b
        best[i], cut[i] = value, start
    runs, end = [], n
    while end > 0:
        runs.append((cut[end], end))
        end = cut[end]
    return runs[::-1], best[n]


class DPScheduler(Scheduler):
    """Plans the queue (its ``plan_window`` oldest requests), runs the planned batch that
    holds the oldest request (so no request waits behind ever-newer short ones), and plans
    again next time: arrivals during a batch join the next plan (planning 256 requests
    takes a few milliseconds)."""

    name = DP

    def __init__(self, limits: BatchLimits, cost: CostTable, *, plan_window: int = 512):
        super().__init__(limits)
        if plan_window < 1:
            raise ValueError(f"plan_window must be a positive integer, got {plan_window!r}")
        self.cost, self.plan_window = cost, plan_window
        self.last_plan: list[list[Request]] = []

    def plan(self, waiting: Sequence[Request]) -> tuple[list[list[Request]], float]:
        ordered = sorted(waiting, key=lambda r: r.length)  # stable: ties keep arrival order
        longest = ordered[-1].length
        rows = self.cost.dense(max(longest, max(self.cost.lengths)), self.limits.max_batch_size)
        runs, total = plan_batches([r.length for r in ordered], rows, self.limits)
        return [ordered[a:b] for a, b in runs], total

    def schedule(self, waiting: Sequence[Request]) -> list[Request]:
        batches, _ = self.plan(waiting[: self.plan_window])  # waiting is in arrival order
        self.last_plan = batches
        oldest = waiting[0]
        return next(batch for batch in batches if oldest in batch)

    def describe(self) -> dict:
        return {**super().describe(), "cost_table": self.cost.to_dict()}
