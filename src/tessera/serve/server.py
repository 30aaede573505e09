"""Putting a server together and running it: bind the socket (first: a port in use is
refused before the model loads; port 0: the OS picks a free one, announced on stdout),
load the model, build the runner, measure the cost table (DP scheduler), start the engine,
serve the app with uvicorn on that socket.

SIGTERM (or SIGINT) drains: the server keeps its socket open and answers new requests
with 503 while the engine finishes every accepted input; then uvicorn shuts down, letting
in-flight responses complete. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from tessera.serve.choices import make_runner, make_scheduler
from tessera.serve.cost import CostTable
from tessera.serve.engine import Engine
from tessera.serve.metrics import ServerMetrics
from tessera.serve.model import check_choice, load_model
from tessera.serve.scheduler import NAMES, BatchLimits
from tessera.serve.service import LocalBackend, Service

log = logging.getLogger(__name__)
SCHEDULERS = NAMES  # from the scheduler classes
RUNNERS = ("auto", "unpadded", "padded")


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    model: str
    task: str = "auto"
    pooling: str = "mean"
    host: str = "127.0.0.1"
    port: int = 8080
    scheduler: str = "dp"
    runner: str = "auto"  # auto: unpadded for dp and one_by_one, padded for the baselines
    attention: str = "per_request"
    memory_plan: bool = False  # unpadded runner with attention "padded": TurboTransformers' memory plan
    # the unpadded runner's dense layers: "tessera" (the compiled kernels; needs a C compiler),
    # "torch" (its own), or "auto": tessera unless the memory plan is on or no compiler is found
    kernels: str = "auto"
    amx: str = "auto"  # Tessera's dense kernels on AMX where the CPU has it ("auto"), or AVX only ("off")
    tuning: str = (
        "model"  # the kernels' tuning: "model" (predicted) or "measure" (timed at start-up, kept on disk)
    )
    max_batch_tokens: int = 16384
    max_batch_size: int = 32
    max_queue: int = 512
    max_client_batch: int = 32
    payload_limit: int = 2_000_000
    overload_status: int = 429
    threads: int | None = None  # torch intra-op threads of each worker
    # engine workers: each its own model copy and runner on a thread of its own, taking the
    # next batch when free. "auto": one per core this process may run on, divided by
    # ``threads`` (2 single-thread workers on 2 cores served more than 1 worker of 2 threads:
    # `tessera bench serve`'s two-core phase)
    workers: int | str = "auto"
    drain_timeout_s: float = 30.0
    cost_table: str | None = None  # JSON file: loaded if present, else measured and written

    def __post_init__(self) -> None:
        check_choice("scheduler", self.scheduler, SCHEDULERS)
        check_choice("runner", self.runner, RUNNERS)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535 (0: any free port), got {self.port}")
        for name in ("max_queue", "max_client_batch", "payload_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.overload_status not in (429, 503):
            raise ValueError(f"overload_status must be 429 or 503, got {self.overload_status}")
        BatchLimits(max_batch_tokens=self.max_batch_tokens, max_batch_size=self.max_batch_size)
        if self.memory_plan and self.runner_name != "unpadded":
            raise ValueError(f"the memory plan is the unpadded runner's; runner is {self.runner_name}")
        if self.workers != "auto" and (not isinstance(self.workers, int) or self.workers < 1):
            raise ValueError(f"workers must be a positive integer or 'auto', got {self.workers!r}")
        check_choice("kernels", self.kernels, ("auto", "tessera", "torch"))
        check_choice("tuning", self.tuning, ("model", "measure"))
        check_choice("amx", self.amx, ("auto", "off"))
        if self.amx != "auto" and self.kernels == "torch":
            raise ValueError(f"--amx {self.amx} chooses how Tessera's dense kernels run; --kernels torch runs torch's")
        if self.kernels == "tessera" and self.runner_name != "unpadded":
            raise ValueError(f"--kernels tessera is the unpadded runner's; runner is {self.runner_name}")

    @property
    def worker_count(self) -> int:
        """``workers`` with "auto" resolved: the cores of this process's affinity over the
        threads a worker runs (1 unless ``threads`` says otherwise)."""
        if self.workers != "auto":
            return self.workers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // (self.threads or 1))

    @property
    def kernels_name(self) -> str:
        """What the unpadded runner's dense layers run on, ``auto`` resolved."""
        if self.kernels != "auto":
            return self.kernels
        if self.memory_plan or self.runner_name != "unpadded":
            return "torch"
        from tessera.kernels.compiler import CompilerError, find_compiler

        try:
            find_compiler()
        except CompilerError:
            log.warning("no C compiler: the dense layers run on torch's kernels (--kernels torch)")
            return "torch"
        return "tessera"

    @property
    def runner_name(self) -> str:
        if self.runner != "auto":
            return self.runner
        return "unpadded" if self.scheduler in ("dp", "one_by_one") else "padded"


def build_engine(config: ServeConfig, served, metrics=None) -> Engine:
    """Runner, limits, (measured) cost table and scheduler for ``served``, as configured."""
    if config.max_batch_tokens < served.max_length:
        raise ValueError(
            f"max_batch_tokens {config.max_batch_tokens} is below the model's input limit {served.max_length}: "
            f"one full-length input must fit a batch"
        )
    options = (
        {
            "attention": config.attention,
            "memory_plan": config.memory_plan,
            "kernels": config.kernels_name,
            "amx": config.amx,
            "tuning": config.tuning,
        }  # fmt: skip
        if config.runner_name == "unpadded"
        else {}
    )
    runner = make_runner(config.runner_name, served, **options)
    limits = BatchLimits(
        max_batch_tokens=config.max_batch_tokens, max_batch_size=config.max_batch_size, padded=runner.padded
    )
    cost = _cost_table(config, runner, served, limits) if config.scheduler == "dp" else None
    scheduler = make_scheduler(config.scheduler, limits, cost)
    if options:  # the workers' dense layers reuse the first runner's packed weights
        options["dense_from"] = runner
    workers = [
        make_runner(
            config.runner_name, dataclasses.replace(served, model=copy.deepcopy(served.model)), **options
        )
        for _ in range(config.worker_count - 1)
    ]  # each on a model copy: a runner swaps the forwards of its own model's modules while it runs
    return Engine(runner, scheduler, max_queue=config.max_queue, observer=metrics, workers=workers)


def _cost_table(config: ServeConfig, runner, served, limits: BatchLimits) -> CostTable:
    path = Path(config.cost_table) if config.cost_table else None
    if path is not None and path.is_file():
        return CostTable.from_dict(json.loads(path.read_text()))
    table = CostTable.measure(
        runner,
        max_length=served.max_length,
        max_batch_size=limits.max_batch_size,
        max_batch_tokens=limits.max_batch_tokens,
    )
    log.info("cost table: %d cells measured in %.1f s", table.measured, table.measure_seconds)
    if path is not None:
        path.write_text(json.dumps(table.to_dict()))
    return table


def _check_cost_table(config: ServeConfig) -> None:
    """A cost table to write (none there yet) needs a writable folder, known before the
    model loads and the table is measured."""
    path = Path(config.cost_table) if config.cost_table else None
    if path is None or path.is_file():
        return
    folder = path.parent
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(f"cannot write the cost table {path}: give a file path in a writable folder")


def build_service(config: ServeConfig) -> Service:
    import torch

    _check_cost_table(config)
    threads = config.threads or (1 if config.worker_count > 1 else None)  # workers: one thread each by default
    if threads:
        torch.set_num_threads(threads)
    served = load_model(config.model, task=config.task, pooling=config.pooling)
    metrics = ServerMetrics()
    engine = build_engine(config, served, metrics).start()
    return Service(served, LocalBackend(engine, config.workers), metrics, max_client_batch=config.max_client_batch)


class DrainingServer:
    """uvicorn's Server with its exit signal turned into a drain first."""

    def __init__(self, app, service: Service, config: ServeConfig):
        import uvicorn

        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                outer.on_signal(sig, frame)

        self.service, self.drain_timeout_s = service, config.drain_timeout_s
        uv_config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=config.drain_timeout_s)
        self.server = _Server(uv_config)
        self._base_exit = uvicorn.Server.handle_exit

    def on_signal(self, sig, frame) -> None:
        if self.service.draining:  # a second signal: stop now
            self._base_exit(self.server, sig, frame)
            return
        log.warning("signal %s: draining (new requests get 503)", sig)
        self.service.begin_drain()
        threading.Thread(target=self._finish, name="tessera-drain", daemon=True).start()

    def _finish(self) -> None:
        idle = self.service.backend.wait_idle(self.drain_timeout_s)
        if not idle:
            log.warning("drain timed out after %.0f s with work left", self.drain_timeout_s)
        self.server.should_exit = True  # uvicorn then lets in-flight responses finish

    async def serve(self, sock: socket.socket, announce) -> None:
        task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started and not task.done():
            await asyncio.sleep(0.01)
        if self.server.started:
            announce()
        await task


def bind(config: ServeConfig) -> socket.socket:
    """The server's address, taken before the model loads: a port in use (or a host this
    machine does not have) is refused at once, not after loading and measuring."""
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as e:
        sock.close()
        raise ValueError(
            f"cannot listen on {config.host}:{config.port} ({e.strerror}): choose another port, or 0 for a free one"
        ) from None
    return sock


def run_server(config: ServeConfig, service: Service | None = None) -> None:
    from tessera.serve.app import create_app

    sock = bind(config)
    try:
        service = service or build_service(config)
    except BaseException:
        sock.close()
        raise
    app = create_app(service, payload_limit=config.payload_limit, overload_status=config.overload_status)
    port = sock.getsockname()[1]
    server = DrainingServer(app, service, config)

    def announce() -> None:
        print(f"tessera serve: listening on http://{config.host}:{port}", flush=True)
        print("tessera serve: " + json.dumps({"port": port, **_summary(config, service)}), flush=True)

    try:
        asyncio.run(server.serve(sock, announce))
    finally:
        service.backend.begin_drain()
        service.backend.wait_idle(1.0)
        sys.stdout.flush()


def _summary(config: ServeConfig, service: Service) -> dict:
    return {
        "model": service.served.name,
        "task": service.served.task,
        "scheduler": config.scheduler,
        "runner": config.runner_name,
        "config": {k: v for k, v in asdict(config).items() if k != "model"},
    }
