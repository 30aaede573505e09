"""The engine: a bounded queue, a scheduler that picks each next batch from it, and a
runner that computes the batch, on one worker thread per runner (``workers``: more runners,
each on its own model copy, take the next batch whenever they are free). It knows nothing of
HTTP; `step()` runs one scheduling decision and one batch synchronously, so tests drive it
directly.

Guarantees, each tested: a request is answered exactly once (its future is set once, or
it is cancelled and never computed); a cancelled request still waiting is taken off the
queue and never reaches the runner; when draining, new work is refused and everything
accepted is finished; a full queue refuses new work with a retry estimate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from tessera.serve.request import DrainingError, QueueFullError, Request
from tessera.serve.scheduler import Scheduler

log = logging.getLogger(__name__)
RunFn = Callable[[list[list[int]]], torch.Tensor]


class Observer(Protocol):
    def on_queue(self, waiting: int) -> None: ...
    def on_batch(self, batch: list[Request], padded_tokens: int, seconds: float) -> None: ...
    def on_cancel(self, count: int) -> None: ...


class Engine:
    def __init__(
        self,
        runner: RunFn,
        scheduler: Scheduler,
        *,
        max_queue: int = 512,
        observer: Observer | None = None,
        workers: list[RunFn] = (),
    ):
        """``runner`` computes batches on the first worker thread; each of ``workers`` (more
        runners, on model copies of their own) on one more."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be a positive integer, got {max_queue!r}")
        self.runner, self.scheduler, self.max_queue, self.observer = runner, scheduler, max_queue, observer
        self.padded = getattr(
            runner, "padded", scheduler.limits.padded
        )  # a runner that does not say: as the limits count
        if scheduler.limits.padded != self.padded:
            raise ValueError(
                f"the scheduler's batch limits count {'padded' if scheduler.limits.padded else 'unpadded'} tokens "
                f"but the runner computes {'padded' if self.padded else 'unpadded'} batches: build BatchLimits("
                f"padded={self.padded})"
            )
        self.runners = [runner, *workers]
        for other in workers:
            if getattr(other, "padded", self.padded) != self.padded:
                raise ValueError(
                    "every worker's runner must compute batches the way the first does (padded or not)"
                )
        self.waiting: list[Request] = []
        self.running: dict[int, list[Request]] = {}  # worker -> its batch
        self.draining = False
        self.counts = {
            "accepted": 0,
            "completed": 0,
            "cancelled": 0,
            "rejected": 0,
            "failed": 0,
            "batches": 0,
        }
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stop = False
        self._batch_seconds = 0.0  # moving average: how soon a batch frees queue slots

    # ---- intake ---------------------------------------------------------------------

    def submit(self, sequences: list[list[int]]) -> list[Request]:
        """Queue every sequence or none: a call's inputs are accepted together."""
        for i, tokens in enumerate(sequences):
            if not tokens or not self.scheduler.limits.admits(len(tokens)):
                raise ValueError(
                    f"input {i} has {len(tokens)} tokens; a batch holds 1 to {self.scheduler.limits.max_batch_tokens}"
                )
        with self._cond:
            if self.draining:
                self.counts["rejected"] += len(sequences)
                raise DrainingError(
                    "the server is draining: it finishes accepted requests and takes no new ones"
                )
            if len(self.waiting) + len(sequences) > self.max_queue:
                self.counts["rejected"] += len(sequences)
                raise QueueFullError(len(self.waiting), self.max_queue, max(0.001, self._batch_seconds))
            requests = [Request(list(tokens)) for tokens in sequences]
            self.waiting.extend(requests)
            self.counts["accepted"] += len(requests)
            self._notify_queue()
            self._cond.notify_all()
        return requests

    def cancel(self, requests: list[Request]) -> int:
        """Drop requests whose caller left; those still waiting never run. Returns how many
        were dropped before compute."""
        with self._cond:
            gone = {r.id for r in requests if r.future.cancel()}  # False once running or done
            before = len(self.waiting)
            self.waiting = [r for r in self.waiting if r.id not in gone]
            dropped = before - len(self.waiting)
            for r in requests:
                r.cancelled = r.cancelled or r.id in gone
            self.counts["cancelled"] += dropped
            self._notify_queue()
            self._cond.notify_all()
        if dropped and self.observer:
            self.observer.on_cancel(dropped)
        return dropped

    # ---- work -----------------------------------------------------------------------

    def step(self, worker: int = 0) -> int:
        """Schedule one batch and run it on ``worker``'s runner; the number of requests run
        (0: nothing waited)."""
        with self._cond:
            if not self.waiting:
                return 0
            batch = self.scheduler.schedule(list(self.waiting))
            self._check(batch)
            chosen = {r.id for r in batch}
            self.waiting = [r for r in self.waiting if r.id not in chosen]
            now = time.monotonic()
            for r in batch:
                r.scheduled_at = now
                r.future.set_running_or_notify_cancel()  # from here on it cannot be cancelled
            self.running[worker] = batch
            self._notify_queue()
        self._run(batch, self.runners[worker])
        with self._cond:
            del self.running[worker]
            self._cond.notify_all()
        return len(batch)

    def _check(self, batch: list[Request]) -> None:
        waiting = {r.id for r in self.waiting}
        assert batch and all(r.id in waiting for r in batch), "scheduler chose a request that is not waiting"
        assert len({r.id for r in batch}) == len(batch), "scheduler chose a request twice"
        lengths = [r.length for r in batch]
        assert self.scheduler.limits.fits(lengths), lengths

    def _run(self, batch: list[Request], runner: RunFn) -> None:
        began = time.perf_counter()
        try:
            outputs = runner([r.tokens for r in batch])
        except Exception as exc:  # the batch's callers get the error; the engine goes on
            log.exception("batch of %d failed", len(batch))
            for r in batch:
                r.future.set_exception(exc)
            self.counts["failed"] += len(batch)
            return
        seconds = time.perf_counter() - began
        finished = time.monotonic()
        # counted (and observed) before the answers go out: a caller who has its answer sees
        # its batch in the counts and the metrics
        self.counts["completed"] += len(batch)
        self.counts["batches"] += 1
        self._batch_seconds = (
            seconds if not self._batch_seconds else 0.8 * self._batch_seconds + 0.2 * seconds
        )
        if self.observer:
            self.observer.on_batch(batch, self.scheduler.limits.tokens([r.length for r in batch]), seconds)
        for r, row in zip(batch, outputs, strict=True):
            r.finished_at = finished
            r.future.set_result(row)  # raises if this future was ever answered before

    def _notify_queue(self) -> None:
        if self.observer:
            self.observer.on_queue(len(self.waiting))

    # ---- the worker thread and shutdown -----------------------------------------------

    def start(self) -> Engine:
        assert not self._threads, "engine already started"
        for worker in range(len(self.runners)):
            thread = threading.Thread(
                target=self._loop, args=(worker,), name=f"tessera-engine-{worker}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        return self

    def _loop(self, worker: int) -> None:
        while True:
            with self._cond:
                while not self.waiting and not self._stop:
                    self._cond.wait()
                if self._stop and not self.waiting:
                    return
            self.step(worker)

    def begin_drain(self) -> None:
        with self._cond:
            self.draining = True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing waits or runs; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.waiting and not self.running, timeout)

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Drain (refuse new work, finish what was accepted), then end the worker thread."""
        self.begin_drain()
        idle = self.wait_idle(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        return idle

    def queue_size(self) -> int:
        return len(self.waiting)
