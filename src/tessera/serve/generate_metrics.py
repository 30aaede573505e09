"""Prometheus metrics of a generation server, in a registry of its own: requests by route
and outcome, the queue's length, step, batch and request latency, images generated and
images per second, the group's health and failures."""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_IMAGES = (1, 2, 4, 8, 16, 32, 64)
OUTCOMES = ("ok", "overloaded", "draining", "unavailable", "validation", "too_large", "cancelled",
            "timeout", "error")  # fmt: skip
ROUTES = ("/v1/images/generations", "/generate", "/jobs")
WINDOW_S = 60.0  # images per second: over the batches that ended in the last minute


class GenerateMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tessera_generate_requests", "HTTP generation requests by route and outcome",
                                ["route", "outcome"], registry=r)  # fmt: skip
        self.queue_size = Gauge("tessera_generate_queue_size", "requests waiting for the group", registry=r)
        self.step_seconds = Histogram("tessera_generate_step_seconds", "seconds per denoising step (rank 0)",
                                      buckets=_SECONDS, registry=r)  # fmt: skip
        self.batch_seconds = Histogram("tessera_generate_batch_seconds", "seconds per batch on the group",
                                       buckets=_SECONDS, registry=r)  # fmt: skip
        self.request_seconds = Histogram("tessera_generate_request_seconds", "seconds per request, end to end",
                                         buckets=_SECONDS, registry=r)  # fmt: skip
        self.batch_images = Histogram("tessera_generate_batch_images", "images per batch", buckets=_IMAGES,
                                      registry=r)  # fmt: skip
        self.images = Counter("tessera_generate_images", "images generated", registry=r)
        self.images_per_second = Gauge("tessera_generate_images_per_second",
                                       f"images generated per second over the last {WINDOW_S:.0f} s", registry=r)  # fmt: skip
        self.healthy = Gauge("tessera_generate_healthy", "1 while the group serves, 0 otherwise", registry=r)
        self.group_failures = Counter("tessera_generate_group_failures",
                                      "batches ended by a rank that raised, died or hung", registry=r)  # fmt: skip
        self._recent: collections.deque = collections.deque()
        for route in ROUTES:
            for outcome in OUTCOMES:
                self.requests.labels(route, outcome)  # every series exists from the start, at 0

    def on_batch(self, images: int, seconds: float, step_seconds: list[float], status: str) -> None:
        self.batch_seconds.observe(seconds)
        self.batch_images.observe(images)
        for s in step_seconds:
            self.step_seconds.observe(s)
        if status == "done":
            self.images.inc(images)
            now = time.monotonic()
            self._recent.append((now, images))
            while self._recent and self._recent[0][0] < now - WINDOW_S:
                self._recent.popleft()
            self.images_per_second.set(sum(n for _, n in self._recent) / WINDOW_S)

    def count(self, route: str, outcome: str) -> None:
        self.requests.labels(route, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
