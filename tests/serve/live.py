"""Real servers for the tests: uvicorn on a free loopback port, in a thread of this process
(fast to start; the engine and the event loop run as in `tessera serve`), or the CLI in a
child process (for signals)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tessera.serve.app import create_app
from tessera.serve.server import ServeConfig, build_service
from tessera.serve.synthetic import EncoderSpec, words

SPEC = EncoderSpec(layers=4, hidden=64, heads=4, vocab_size=300, max_length=256)
# ~20 ms per 250-token input on a core: slow enough that a queue stays full while a test acts
SLOW_SPEC = EncoderSpec(layers=4, hidden=256, heads=4, vocab_size=300, max_length=256, seed=1)
# fp32, the unpadded batch against one input alone: see test_unpadded.py for why 1e-5.
ATOL = 1e-5


def text(n: int, seed: int = 0) -> str:
    return words(n, seed=seed, vocab_size=SPEC.vocab_size)


def metric(client, name: str, **labels) -> float:
    """One sample from the server's /metrics (parsed by prometheus_client's own parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")


@contextlib.contextmanager
def thread_server(config: ServeConfig, service=None):
    """Yields (base url, service); ``service`` defaults to the local engine's."""
    import uvicorn

    service = service or build_service(config)
    app = create_app(service, payload_limit=config.payload_limit, overload_status=config.overload_status)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30  # a hang guard, not a timing check: 30 s is far above any start
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", service
    finally:
        server.should_exit = True
        thread.join(10)
        if hasattr(service.backend, "engine"):
            service.backend.engine.stop(timeout=5)


@contextlib.contextmanager
def cli_server(*args: str, timeout: float = 60.0):
    """`tessera serve ... --port 0` as a child process; yields (base url, process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "tessera.cli", "serve", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    listening = threading.Event()

    def read():  # keep reading, so a chatty server never blocks on a full pipe
        for line in proc.stdout:
            lines.append(line)
            if "listening on " in line:
                listening.set()
        listening.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        listening.wait(timeout)
        found = [ln for ln in lines if "listening on " in ln]
        assert found, "server did not start:\n" + "".join(lines)
        proc.output = lines
        yield found[0].split("listening on ", 1)[1].strip(), proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(10)
