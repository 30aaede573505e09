"""Scale-out on Ray Serve: N replicas, each holding the same engine (runner, DP scheduler,
bounded queue) as the local server, behind the same HTTP app.

Ray Serve routes each call to a replica; inside it, ``@serve.batch`` with a token-count
``batch_size_fn`` gathers the inputs of concurrent calls up to the token budget and hands
them to the replica's engine, whose scheduler cuts them into batches. The HTTP front (TEI
and OpenAI routes, limits, drain, metrics of requests and tokenization) is Tessera's app in
this process, calling the replicas through a deployment handle. ``pip install
'tessera[ray]'``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading

import torch

from tessera.serve.server import ServeConfig, run_server
from tessera.serve.service import ClientGone, Service, Timings

log = logging.getLogger(__name__)
BATCH_WAIT_S = 0.005  # how long a replica waits for more inputs before running what it has


def _replica_class(config: ServeConfig):
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class TesseraReplica:
        def __init__(self, config_dict: dict):
            from tessera.serve.model import load_model
            from tessera.serve.server import build_engine

            if config_dict.get("workers") == "auto":  # the replicas are the parallelism: one worker each
                config_dict = {**config_dict, "workers": 1}
            cfg = ServeConfig(**config_dict)
            if cfg.threads:
                torch.set_num_threads(cfg.threads)
            served = load_model(cfg.model, task=cfg.task, pooling=cfg.pooling)
            self.engine = build_engine(cfg, served).start()

        @serve.batch(
            max_batch_size=config.max_batch_tokens,
            batch_wait_timeout_s=BATCH_WAIT_S,
            batch_size_fn=lambda items: sum(len(tokens) for tokens in items),
        )
        async def run_inputs(self, items: list[list[int]]) -> list[list[float]]:
            requests = self.engine.submit(items)
            rows = await asyncio.gather(*(asyncio.wrap_future(r.future) for r in requests))
            return [row.tolist() for row in rows]

        async def infer(self, sequences: list[list[int]]) -> list[list[float]]:
            return list(await asyncio.gather(*(self.run_inputs(s) for s in sequences)))

        def counts(self) -> dict:
            return dict(self.engine.counts)

    return TesseraReplica


class RayBackend:
    """The service's backend when the engines live in Ray Serve replicas."""

    def __init__(self, handle, config: ServeConfig, replicas: int):
        self.handle, self.config, self.replicas = handle, config, replicas
        self._in_flight = 0
        self._idle = threading.Condition()

    async def infer(self, sequences, gone, timings: Timings):
        with self._idle:
            self._in_flight += 1
        try:
            response = self.handle.infer.remote(sequences)
            answer = asyncio.ensure_future(_await(response))
            watcher = asyncio.ensure_future(gone())
            done, _ = await asyncio.wait({answer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            watcher.cancel()
            if answer not in done:
                response.cancel()
                raise ClientGone
            return [torch.tensor(row) for row in answer.result()]
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def queue_size(self) -> int:
        return self._in_flight

    def begin_drain(self) -> None:
        pass  # the service refuses new work; replicas finish what they were given

    def wait_idle(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def describe(self) -> dict:
        return {
            "scheduler": {"name": self.config.scheduler, "max_batch_tokens": self.config.max_batch_tokens,
                          "max_batch_size": self.config.max_batch_size},
            "runner": {"name": self.config.runner_name},
            "max_queue": self.config.max_queue,
            "ray": {"replicas": self.replicas, "batching": "serve.batch by token count"},
        }  # fmt: skip


async def _await(response):
    return await response


def start_ray_service(config: ServeConfig, replicas: int) -> Service:
    """A local Ray instance (unless one is running), the replicas deployed, and the service
    that fronts them."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ValueError(f"--ray needs Ray Serve: pip install 'tessera[ray]' ({exc})") from None
    from tessera.serve.metrics import ServerMetrics
    from tessera.serve.model import load_model

    served = load_model(config.model, task=config.task, pooling=config.pooling)  # tokenizer and checks here
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no telemetry
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")  # HTTP is Tessera's app; replicas are reached by handle
    app = _replica_class(config).options(num_replicas=replicas).bind(dataclasses.asdict(config))
    handle = serve.run(app, name="tessera", route_prefix=None)
    backend = RayBackend(handle, config, replicas)
    return Service(served, backend, ServerMetrics(), max_client_batch=config.max_client_batch)


def run_ray(config: ServeConfig, *, replicas: int) -> None:
    service = start_ray_service(config, replicas)
    try:
        run_server(config, service)
    finally:
        from ray import serve

        serve.shutdown()
