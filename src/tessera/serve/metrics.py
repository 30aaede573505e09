"""Prometheus metrics of one server, in a registry of its own (two servers in one process,
as in tests, do not share counters). The engine reports through the `Observer` methods;
the HTTP layer counts requests by outcome and times tokenization."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tessera.serve.request import Request

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKENS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
OUTCOMES = ("ok", "overloaded", "draining", "validation", "too_large", "cancelled", "error")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tessera_requests", "HTTP requests by route and outcome", ["route", "outcome"], registry=r
        )
        self.inputs = Counter("tessera_inputs", "inputs (texts) computed", registry=r)
        self.cancelled = Counter(
            "tessera_cancelled_inputs", "inputs dropped before compute: caller left", registry=r
        )
        self.queue_size = Gauge("tessera_queue_size", "inputs waiting in the engine's queue", registry=r)
        self.batch_size = Histogram("tessera_batch_size", "inputs per batch", buckets=_SIZES, registry=r)
        self.batch_tokens = Histogram(
            "tessera_batch_tokens", "real tokens per batch", buckets=_TOKENS, registry=r
        )
        self.batch_computed_tokens = Histogram(
            "tessera_batch_computed_tokens", "tokens the runner computes per batch (padding included)",
            buckets=_TOKENS, registry=r,
        )  # fmt: skip
        stage = "seconds per {}"
        self.tokenization = Histogram(
            "tessera_tokenization_seconds",
            stage.format("request in tokenization"),
            buckets=_SECONDS,
            registry=r,
        )
        self.queue = Histogram(
            "tessera_queue_seconds", stage.format("input waiting"), buckets=_SECONDS, registry=r
        )
        self.inference = Histogram(
            "tessera_inference_seconds", stage.format("batch forward"), buckets=_SECONDS, registry=r
        )
        self.request_seconds = Histogram(
            "tessera_request_seconds", stage.format("request end to end"), buckets=_SECONDS, registry=r
        )
        for route in ("/embed", "/predict", "/v1/embeddings"):
            for outcome in OUTCOMES:
                self.requests.labels(route, outcome)  # every series exists from the start, at 0

    # the engine's Observer
    def on_queue(self, waiting: int) -> None:
        self.queue_size.set(waiting)

    def on_batch(self, batch: list[Request], padded_tokens: int, seconds: float) -> None:
        self.batch_size.observe(len(batch))
        self.batch_tokens.observe(sum(r.length for r in batch))
        self.batch_computed_tokens.observe(padded_tokens)
        self.inference.observe(seconds)
        self.inputs.inc(len(batch))
        for r in batch:
            self.queue.observe(r.queue_seconds())

    def on_cancel(self, count: int) -> None:
        self.cancelled.inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
