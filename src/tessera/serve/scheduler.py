"""Batch schedulers: which waiting requests run together next.

Every scheduler answers one question, ``schedule(waiting) -> batch``: given the waiting
requests in arrival order, the ones to run now (the engine takes them off the queue). So
they are swappable under one engine and testable without a model or HTTP (as vLLM tests
its scheduler with fake runner outputs). Here are the baselines the TurboTransformers
scheduler (`dp_scheduler.py`) is measured against, each as the serving system it stands
for does it:

- `FifoPadded`: text-embeddings-inference's queue: arrival order, a batch grows while its
  tokens stay within the token budget and the request count within its limit.
- `SortWindow`: infinity-emb's `pop_optimal_batches`: take a window of whole batches off
  the head of the queue (as many as the queue fills, at most ``max_windows``), sort the
  window by length, cut it into batches of ``max_batch_size``, run them in turn.
- `OneByOne`: one request at a time, in arrival order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tessera.serve.request import Request


@dataclass(frozen=True, kw_only=True)
class BatchLimits:
    """What one batch may hold: ``max_batch_tokens`` counts its tokens as the runner computes
    them (``padded``: longest input x batch size, the memory a padded batch takes; else the
    sum of the lengths, an unpadded runner's: TEI's queue counts the same way for its padded
    and unpadded backends); ``max_batch_size`` counts requests."""

    max_batch_tokens: int = 16384
    max_batch_size: int = 32
    padded: bool = True

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def admits(self, length: int) -> bool:
        return length <= self.max_batch_tokens

    def tokens(self, lengths: Sequence[int]) -> int:
        """The tokens a batch of these input lengths computes."""
        return max(lengths) * len(lengths) if self.padded else sum(lengths)

    def fits(self, lengths: Sequence[int]) -> bool:
        return len(lengths) <= self.max_batch_size and self.tokens(lengths) <= self.max_batch_tokens


class Scheduler(ABC):
    """Chooses the next batch (whether a batch is padded is the runner's to say: its
    ``padded``, which the engine reads)."""

    name: str = "scheduler"

    def __init__(self, limits: BatchLimits):
        self.limits = limits

    @abstractmethod
    def schedule(self, waiting: Sequence[Request]) -> list[Request]:
        """The requests to run now, a non-empty subset of ``waiting`` (non-empty, in
        arrival order) that ``self.limits.fits``."""

    def describe(self) -> dict:
        return {
            "name": self.name,
            "max_batch_tokens": self.limits.max_batch_tokens,
            "max_batch_size": self.limits.max_batch_size,
        }


class OneByOne(Scheduler):
    name = "one_by_one"

    def schedule(self, waiting: Sequence[Request]) -> list[Request]:
        return [waiting[0]]


class FifoPadded(Scheduler):
    name = "fifo_padded"

    def schedule(self, waiting: Sequence[Request]) -> list[Request]:
        batch: list[Request] = []
        lengths: list[int] = []
        for request in waiting:
            if batch and not self.limits.fits([*lengths, request.length]):
                break
            batch.append(request)
            lengths.append(request.length)
            if len(batch) == self.limits.max_batch_size:
                break
        return batch


class SortWindow(Scheduler):
    """infinity-emb's batching. Its batches are counted in requests only (it has no token
    budget); the budget here only guards memory and binds at the limits' defaults
    (32 x 512 = 16384) never."""

    name = "sort_window"

    def __init__(self, limits: BatchLimits, *, max_windows: int = 32):
        super().__init__(limits)
        if max_windows < 1:
            raise ValueError(f"max_windows must be a positive integer, got {max_windows!r}")
        self.max_windows = max_windows
        self._pending: deque[list[Request]] = deque()

    def schedule(self, waiting: Sequence[Request]) -> list[Request]:
        live = {r.id for r in waiting}
        while self._pending:
            batch = [r for r in self._pending.popleft() if r.id in live]  # cancelled ones are gone
            if batch:
                return self._within_budget(batch)
        size = self.limits.max_batch_size
        windows = min(self.max_windows, max(1, len(waiting) // size))
        window = list(waiting[: size * windows])
        if windows > 1:
            window.sort(key=lambda r: r.length)  # stable: equal lengths keep arrival order
        self._pending.extend(window[i * size : (i + 1) * size] for i in range(windows))
        return self._within_budget(self._pending.popleft())

    def _within_budget(self, batch: list[Request]) -> list[Request]:
        keep = 0
        for keep in range(1, len(batch) + 1):
            if not self.limits.fits([r.length for r in batch[:keep]]):
                keep -= 1
                break
        if keep < len(batch):
            self._pending.appendleft(batch[keep:])
        return batch[:keep]


DP = "dp"  # tessera.serve.dp_scheduler.DPScheduler's name (that module imports numpy; this one does not)
BASELINES: tuple[type[Scheduler], ...] = (OneByOne, FifoPadded, SortWindow)
NAMES = (DP, *(cls.name for cls in BASELINES))  # what --scheduler takes, from the classes
