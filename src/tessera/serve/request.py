"""One unit of work for the engine: the token ids of one input, when it arrived, and the
future its answer is delivered through (exactly once)."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

_ids = itertools.count()


@dataclass(eq=False)
class Request:
    tokens: list[int]
    arrival: float = field(default_factory=time.monotonic)
    id: int = field(default_factory=lambda: next(_ids))
    future: Future = field(default_factory=Future)
    scheduled_at: float | None = None  # when its batch was chosen (end of its queue time)
    finished_at: float | None = None
    cancelled: bool = False

    @property
    def length(self) -> int:
        return len(self.tokens)

    def queue_seconds(self) -> float:
        return (self.scheduled_at or time.monotonic()) - self.arrival


class QueueFullError(RuntimeError):
    """The engine's queue holds its limit of waiting requests."""

    def __init__(self, waiting: int, limit: int, retry_after_s: float):
        super().__init__(
            f"queue full: {waiting} waiting of {limit}; retry after {retry_after_s * 1000:.0f} ms"
        )
        self.retry_after_s = retry_after_s


class DrainingError(RuntimeError):
    """The engine is draining (shutting down) and takes no new work."""
