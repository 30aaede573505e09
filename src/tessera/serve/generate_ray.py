"""Scale-out of the generation server on Ray Serve: R replicas, each holding its own group
of ranks (``RankGroup``: N processes, the model loaded once per rank), behind one HTTP front.

The front is the same app, queue and scheduler as the local server; it runs one dispatcher
per replica, and each sends its batch through a deployment handle, so Ray Serve routes it to
a free replica (one batch at a time each: ``max_ongoing_requests=1``). A replica whose rank
raised or died answers the error naming the rank, restarts its group, and fails Ray Serve's
health check while it cannot (Ray then replaces it). ``pip install 'tessera[ray]'``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from tessera.serve.generate_group import GroupError, RankGroup
from tessera.serve.generate_rank import Batch, Outcome

log = logging.getLogger(__name__)


def _replica_class():
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1)
    class GenerateReplica:
        def __init__(self, config):
            self.group = RankGroup(config.model, config.layout, threads=config.threads,
                                   load_timeout_s=config.load_timeout_s, vae=config.vae).start()  # fmt: skip

        async def run(self, batch: Batch) -> dict:
            stop = threading.Event()
            work = asyncio.get_running_loop().run_in_executor(None, self._run, batch, stop)
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:  # the front cancelled: stop at the next step
                stop.set()
                raise

        def _run(self, batch: Batch, stop: threading.Event) -> dict:
            try:
                outcome = self.group.run(batch, stop.is_set)
            except GroupError as exc:
                self.group.restart()  # a failure here fails the health check below
                return {"error": [exc.rank, exc.message]}
            return {"status": outcome.status, "images": outcome.images, "step_seconds": outcome.step_seconds}

        def pids(self) -> list[int]:
            return self.group.pids

        def check_health(self) -> None:
            if not self.group.alive():
                raise RuntimeError("a rank of this replica's group is gone")

    return GenerateReplica


class RayGroup:
    """The front's view of the replicas, shaped as the RankGroup the service drives."""

    def __init__(self, handle, layout, replicas: int):
        self.handle, self.config, self.replicas = handle, layout, replicas
        self.world_size = layout.world_size  # ranks per replica
        self.pids: list[int] = []

    def start(self) -> RayGroup:
        return self

    def close(self) -> None:
        pass

    def restart(self) -> None:
        pass  # each replica restarts its own group

    def check(self) -> None:
        pass  # Ray Serve checks each replica's health

    def progress(self, batch_id: int) -> int:
        return -1  # steps are not reported across Ray

    def run(self, batch: Batch, should_stop) -> Outcome:
        response = self.handle.run.remote(batch)
        while True:
            try:
                answer = response.result(timeout_s=0.1)
                break
            except TimeoutError:
                if should_stop():
                    response.cancel()
                    return Outcome(0, batch.id, "cancelled")
        if "error" in answer:
            raise GroupError(*answer["error"])
        return Outcome(0, batch.id, answer["status"], answer["images"], answer["step_seconds"])


def start_generate_ray(config, replicas: int):
    """(service, metrics): a local Ray instance (unless one is running), the replicas
    deployed (each loads its group), and the front's service over them."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ValueError(f"--ray needs Ray Serve: pip install 'tessera[ray]' ({exc})") from None
    from tessera.serve.generate_metrics import GenerateMetrics
    from tessera.serve.generate_service import GenerateService
    from tessera.serve.generate_spec import model_spec

    spec = model_spec(config.model, config.layout, list(config.sizes) or None, config.vae, config.nproc)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no telemetry
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")  # HTTP is Tessera's app; replicas are reached by handle
    began = time.monotonic()
    app = _replica_class().options(num_replicas=replicas).bind(config)
    handle = serve.run(app, name="tessera-generate", route_prefix=None)
    log.info("%d replicas ready in %.1f s", replicas, time.monotonic() - began)
    metrics = GenerateMetrics()
    service = GenerateService(spec, RayGroup(handle, config.layout, replicas), limits=config.limits,
                              max_queue=config.max_queue, request_timeout_s=config.request_timeout_s,
                              metrics=metrics, workers=replicas)  # fmt: skip
    return service.start(), metrics


def run_generate_ray(config, *, replicas: int) -> None:
    from tessera.serve.generate_server import run_generate_server

    service, metrics = start_generate_ray(config, replicas)
    try:
        run_generate_server(config, service, metrics, replicas=replicas)
    finally:
        from ray import serve

        serve.shutdown()
