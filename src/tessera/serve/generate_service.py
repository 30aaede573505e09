"""The generation server's queue, scheduler and dispatcher, between the HTTP app and the
group of ranks.

A bounded first-come queue of requests (full: QueueFullError, answered 429 with
Retry-After). One dispatcher thread takes the oldest request and every later waiting one
with the same image size, step count and guidance scale, up to ``max_batch_images``
images, and runs them as one batch on the group; the others wait their turn in arrival
order. A request that is cancelled (DELETE, or its client left) or passes its deadline is
dropped from the queue, or from its batch; a batch nobody waits for any more is stopped at
the next step boundary, freeing the group for the next one.

A failed batch (a rank raised or died, or the group did not stop) fails its requests with
the rank's error, and the group is restarted (the model reloaded); after ``max_restarts``
failed restarts in a row the service reports itself unhealthy and refuses work.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from tessera.serve.generate_group import GroupError, RankGroup
from tessera.serve.generate_rank import Batch, Part
from tessera.serve.generate_spec import Limits, ModelSpec
from tessera.serve.request import DrainingError, QueueFullError

log = logging.getLogger(__name__)
_ids = itertools.count(1)
_batch_ids = itertools.count(1)


class RequestCancelled(RuntimeError):
    """The request was cancelled (by DELETE or because its client disconnected)."""


class RequestTimeout(RuntimeError):
    """The request passed its deadline."""


class Unavailable(RuntimeError):
    """The service is unhealthy (its group could not be restarted) or restarting."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One request's generation settings, already checked against the model."""

    height: int
    width: int
    steps: int
    guidance: float
    seed: int
    labels: tuple[int, ...] = ()  # class-conditional models
    prompt: str = ""  # text-conditioned pipelines
    negative_prompt: str = ""
    count: int = 1
    frames: int = 0  # video pipelines: the frame count (0: an image model)

    @property
    def images(self) -> int:
        return len(self.labels) if self.labels else self.count

    @property
    def shape_key(self) -> tuple:
        """Requests with the same key can share a batch."""
        return (self.height, self.width, self.steps, self.guidance, self.frames)


@dataclass(eq=False)
class GenerationRequest:
    settings: Settings
    timeout_s: float
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)
    status: str = "queued"  # queued | running | done | cancelled | timeout | failed
    batch_id: int | None = None
    batch_images: int = 0
    started: float | None = None
    finished: float | None = None
    error: str | None = None

    @property
    def deadline(self) -> float:
        return self.arrival + self.timeout_s

    def finish(self, status: str, *, result=None, error: BaseException | None = None) -> bool:
        """Settle the request once (later calls do nothing); True if this call settled it."""
        if self.future.done():
            return False
        self.status, self.finished = status, time.monotonic()
        if error is not None:
            self.error = str(error)
            self.future.set_exception(error)
        else:
            self.future.set_result(result)
        return True


class GenerateService:
    """Queue, scheduler and dispatcher over one RankGroup (started by ``start``)."""

    def __init__(self, spec: ModelSpec, group: RankGroup, *, limits: Limits, max_queue: int = 64,
                 request_timeout_s: float = 300.0, max_restarts: int = 3, metrics=None,
                 keep_jobs: int = 256, workers: int = 1):  # fmt: skip
        if max_queue < 1:
            raise ValueError(f"max_queue must be a positive integer, got {max_queue}")
        self.spec, self.group, self.limits = spec, group, limits
        self.max_queue, self.request_timeout_s, self.max_restarts = max_queue, request_timeout_s, max_restarts
        self.metrics = metrics
        self.state = "starting"  # starting | ok | restarting | unhealthy
        self.draining = False
        self.last_failure: str | None = None
        self.queue: deque[GenerationRequest] = deque()
        self.running: set[GenerationRequest] = set()
        self.workers = workers  # dispatchers: one per group the batches can go to (Ray: replicas)
        self.jobs: OrderedDict[int, GenerationRequest] = OrderedDict()  # for the polling routes
        self.keep_jobs = keep_jobs
        self.cond = threading.Condition()
        self.batch_seconds = 0.0  # running mean of a batch's time, for Retry-After
        self.restarts = 0
        self._stop = False
        self._threads: list[threading.Thread] = []
        self.fault_drill: int | None = None  # tests: the next batch makes this rank raise

    # ---- life -------------------------------------------------------------------------

    def start(self) -> GenerateService:
        self.group.start()
        self.state = "ok"
        self._set_health()
        for i in range(self.workers):
            thread = threading.Thread(target=self._dispatch_loop, name=f"tessera-generate-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        for thread in self._threads:
            thread.join(30)
        self.group.close()

    def begin_drain(self) -> None:
        self.draining = True

    def wait_idle(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: not self.queue and not self.running, timeout)

    # ---- requests ---------------------------------------------------------------------

    def submit(self, settings: Settings, timeout_s: float | None = None) -> GenerationRequest:
        if self.draining:
            raise DrainingError("the server is draining: no new requests")
        if self.state == "unhealthy":
            raise Unavailable(f"the server is unhealthy: {self.last_failure}")
        request = GenerationRequest(settings, timeout_s or self.request_timeout_s)
        with self.cond:
            if len(self.queue) >= self.max_queue:
                raise QueueFullError(len(self.queue), self.max_queue, self.retry_after_s())
            self.queue.append(request)
            self.jobs[request.id] = request
            while len(self.jobs) > self.keep_jobs:
                oldest = next(iter(self.jobs.values()))
                if not oldest.future.done():
                    break
                self.jobs.popitem(last=False)
            self.cond.notify_all()
        self._set_queue()
        return request

    def cancel(self, request: GenerationRequest, reason: BaseException) -> bool:
        """Drop ``request`` (from the queue or its batch); its batch is stopped at the next
        step if nobody else waits for it. False if it had already finished."""
        status = "timeout" if isinstance(reason, RequestTimeout) else "cancelled"
        with self.cond:
            if request in self.queue:
                self.queue.remove(request)
            settled = request.finish(status, error=reason)
            self.cond.notify_all()
        self._set_queue()
        return settled

    def retry_after_s(self) -> float:
        """A guess of when a queue slot frees: the mean batch time per batch ahead."""
        per_batch = self.batch_seconds or 1.0
        images = sum(r.settings.images for r in self.queue)
        return max(1.0, per_batch * math.ceil(max(images, 1) / self.limits.max_batch_images))

    def progress(self, request: GenerationRequest) -> dict:
        step = self.group.progress(request.batch_id) if request.status == "running" else -1
        with self.cond:
            position = next((i for i, r in enumerate(self.queue) if r is request), None)
        return {
            "id": request.id,
            "status": request.status,
            "step": request.settings.steps if request.status == "done" else max(step, 0),
            "steps": request.settings.steps,
            "queue_position": position,
            "batch_images": request.batch_images,
            "error": request.error,
        }

    # ---- the dispatcher ---------------------------------------------------------------

    def _next_batch(self) -> list[GenerationRequest]:
        """The oldest request and the later ones it can share a batch with (first-come)."""
        head = self.queue.popleft()
        chosen, images = [head], head.settings.images
        for r in list(self.queue) if self.limits.batching else []:
            if r.settings.shape_key == head.settings.shape_key:
                if images + r.settings.images > self.limits.max_batch_images:
                    break
                self.queue.remove(r)
                chosen.append(r)
                images += r.settings.images
        return chosen

    def _expire(self) -> None:
        now = time.monotonic()
        with self.cond:
            waiting = [*self.queue, *self.running]
        for r in waiting:
            if now > r.deadline and not r.future.done():
                self.cancel(r, RequestTimeout(f"timed out after {r.timeout_s:g} s ({self._where(r)})"))

    def _where(self, r: GenerationRequest) -> str:
        if r.status != "running":
            return "still queued"
        return f"at step {max(self.group.progress(r.batch_id), 0)} of {r.settings.steps}"

    def _dispatch_loop(self) -> None:
        while True:
            self._expire()  # the lock is not held here: cancel takes it briefly
            with self.cond:
                if not self._stop and not self.queue:
                    self.cond.wait(0.1)
                if self._stop:
                    return
                requests = self._next_batch() if self.queue else None
                if requests:
                    self.running.update(requests)
            if requests is None:
                self._check_idle_group()
                continue
            self._set_queue()
            try:
                self._run(requests)
            except Exception:  # noqa: BLE001 - the dispatcher must live on
                log.exception("dispatcher failed")
            with self.cond:
                self.running.difference_update(requests)
                self.cond.notify_all()

    def _run(self, requests: list[GenerationRequest]) -> None:
        s = requests[0].settings
        parts = tuple(Part(request_id=r.id, seed=r.settings.seed, labels=r.settings.labels,
                           prompt=r.settings.prompt, negative_prompt=r.settings.negative_prompt,
                           count=r.settings.count) for r in requests)  # fmt: skip
        batch = Batch(id=next(_batch_ids), height=s.height, width=s.width, steps=s.steps,
                      guidance=s.guidance, parts=parts, frames=s.frames, fail_on_rank=self.fault_drill)  # fmt: skip
        self.fault_drill = None
        began = time.monotonic()
        for r in requests:
            r.status, r.batch_id, r.started, r.batch_images = "running", batch.id, began, batch.images

        def should_stop() -> bool:
            self._expire()
            return all(r.future.done() for r in requests)

        try:
            outcome = self.group.run(batch, should_stop)
        except GroupError as exc:
            for r in requests:
                r.finish("failed", error=exc)
            self._observe_failure(exc)
            self._recover(exc)
            return
        seconds = time.monotonic() - began
        if outcome.status == "done":
            self._deliver(requests, outcome.images, seconds)
            self.batch_seconds = (
                seconds if not self.batch_seconds else 0.8 * self.batch_seconds + 0.2 * seconds
            )
        if self.metrics is not None:
            self.metrics.on_batch(batch.images, seconds, outcome.step_seconds, outcome.status)

    def _check_idle_group(self) -> None:
        """A rank that died between batches: restart now (or report unhealthy)."""
        if self.state != "ok" or self.running:
            return
        try:
            self.group.check()
        except GroupError as exc:
            self._observe_failure(exc)
            self._recover(exc)

    def _deliver(self, requests: list[GenerationRequest], images: list[bytes], seconds: float) -> None:
        offset = 0
        for r in requests:
            mine = images[offset : offset + r.settings.images]
            offset += r.settings.images
            r.finish("done", result={"images": mine, "batch_images": len(images), "inference_s": seconds,
                                     "queue_s": r.started - r.arrival})  # fmt: skip

    def _recover(self, exc: GroupError) -> None:
        self.last_failure = str(exc)
        log.error("group failed (%s): restarting the ranks", exc)
        self.state = "restarting"
        self._set_health()
        for attempt in range(1, self.max_restarts + 1):
            try:
                self.group.restart()
                self.restarts += 1
                self.state = "ok"
                self._set_health()
                return
            except Exception as again:  # noqa: BLE001
                self.last_failure = f"restart {attempt} failed: {again}"
                log.error(self.last_failure)
        self.state = "unhealthy"
        self._set_health()
        with self.cond:
            waiting = list(self.queue)
            self.queue.clear()
        for r in waiting:
            r.finish("failed", error=Unavailable(f"the server is unhealthy: {self.last_failure}"))

    # ---- metrics ----------------------------------------------------------------------

    def _set_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_size.set(len(self.queue))

    def _set_health(self) -> None:
        if self.metrics is not None:
            self.metrics.healthy.set(1 if self.state == "ok" else 0)

    def _observe_failure(self, exc: GroupError) -> None:
        if self.metrics is not None:
            self.metrics.group_failures.inc()
