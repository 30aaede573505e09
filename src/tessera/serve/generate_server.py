"""`tessera serve --task generate`: a generation server put together and run.

The socket is bound first (a port in use is refused before any rank starts; port 0 picks
a free one, announced on stdout), the model's spec is read and every served size checked
against the layout, the group of ranks is started (each loads the model once), then the app
is served with uvicorn. SIGTERM drains: new requests get 503 while the accepted ones
finish; a second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from dataclasses import asdict, dataclass, field

from tessera.serve.generate_group import RankGroup
from tessera.serve.generate_metrics import GenerateMetrics
from tessera.serve.generate_service import GenerateService
from tessera.serve.generate_spec import Limits, model_spec

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GenerateServeConfig:
    model: str
    layout: object = None  # a ParallelConfig (None: serial)
    nproc: int = 1
    host: str = "127.0.0.1"
    port: int = 8080
    sizes: tuple[tuple[int, int], ...] = ()  # (height, width); empty: the model's own size
    limits: Limits = field(default_factory=Limits)
    max_queue: int = 64
    request_timeout_s: float = 300.0
    payload_limit: int = 1_000_000
    threads: int = 1  # torch threads per rank
    drain_timeout_s: float = 30.0
    load_timeout_s: float = 300.0
    max_restarts: int = 3
    parallel_vae: bool = False  # pipelines: every rank decodes a band of the latent's rows
    vae_chunk_rows: int | None = None  # pipelines: the VAE's convolutions over chunks of rows

    @property
    def vae(self) -> dict:
        return {"parallel_vae": self.parallel_vae, "vae_chunk_rows": self.vae_chunk_rows}

    def __post_init__(self) -> None:
        from tessera.diffusion.layout import ParallelConfig

        if self.layout is None:
            object.__setattr__(self, "layout", ParallelConfig())
        if self.layout.world_size != self.nproc:
            raise ValueError(f"parallel layout {self.layout.describe()} needs {self.layout.world_size} processes "
                             f"but --nproc is {self.nproc}")  # fmt: skip
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535 (0: any free port), got {self.port}")
        for name in ("max_queue", "threads", "payload_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("request_timeout_s", "drain_timeout_s", "load_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive seconds, got {getattr(self, name)}")


def build_generate_service(config: GenerateServeConfig, metrics: GenerateMetrics | None = None):
    """(service started, metrics): the spec checked, the group of ranks loaded."""
    spec = model_spec(config.model, config.layout, list(config.sizes) or None, config.vae, config.nproc)
    group = RankGroup(
        config.model,
        config.layout,
        threads=config.threads,
        load_timeout_s=config.load_timeout_s,
        vae=config.vae,
    )
    metrics = metrics or GenerateMetrics()
    service = GenerateService(spec, group, limits=config.limits, max_queue=config.max_queue,
                              request_timeout_s=config.request_timeout_s, max_restarts=config.max_restarts,
                              metrics=metrics)  # fmt: skip
    return service.start(), metrics


def generate_app(config: GenerateServeConfig, service: GenerateService, metrics: GenerateMetrics, **extra):
    from importlib.metadata import PackageNotFoundError, version

    from tessera.serve.generate_app import create_generate_app

    try:
        tessera_version = version("tessera")
    except PackageNotFoundError:
        tessera_version = "0"
    info = {"version": tessera_version, "nproc": config.nproc, **extra}
    return create_generate_app(service, metrics, info=info, payload_limit=config.payload_limit)


class _Drain:
    """The face DrainingServer expects: draining, begin_drain, backend.wait_idle."""

    def __init__(self, service):
        self.service = self.backend = service

    @property
    def draining(self) -> bool:
        return self.service.draining

    def begin_drain(self) -> None:
        self.service.begin_drain()

    def wait_idle(self, timeout: float) -> bool:
        return self.service.wait_idle(timeout)


def run_generate_server(config: GenerateServeConfig, service=None, metrics=None, **extra) -> None:
    from tessera.serve.server import DrainingServer, bind

    sock = bind(config)
    try:
        if service is None:
            service, metrics = build_generate_service(config)
    except BaseException:
        sock.close()
        raise
    app = generate_app(config, service, metrics, **extra)
    port = sock.getsockname()[1]
    server = DrainingServer(app, _Drain(service), config)

    def announce() -> None:
        print(f"tessera serve: listening on http://{config.host}:{port}", flush=True)
        summary = {"port": port, "task": "generate", "model": service.spec.name, "layout": config.layout.describe(),
                   "ranks": config.nproc, "sizes": service.spec.size_names(), "limits": asdict(config.limits)}  # fmt: skip
        print("tessera serve: " + json.dumps(summary), flush=True)

    try:
        asyncio.run(server.serve(sock, announce))
    finally:
        service.begin_drain()
        service.wait_idle(1.0)
        service.stop()
        sys.stdout.flush()


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1"):
    """uvicorn serving ``app`` on a free port of ``host``, in a thread of this process (tests,
    benchmarks); yields the base url."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket()
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
