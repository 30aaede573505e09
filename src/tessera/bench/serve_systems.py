"""The systems `tessera bench serve` measures, as server processes: Tessera's server with
each scheduler, and infinity-emb in a virtual environment of its own (it pins
transformers <= 5.0). Each server is pinned to one core with one torch thread; the load
generator gets the other core."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

INFINITY_VENV = Path(".cache/infinity-venv")
INFINITY_PIN = "infinity-emb[server,torch]==0.0.78"
TESSERA_SYSTEMS = {
    "one_by_one": ["--scheduler", "one_by_one"],
    "fifo_padded": ["--scheduler", "fifo_padded"],
    "sort_window": ["--scheduler", "sort_window"],
    "tessera": ["--scheduler", "dp"],
    "tessera_memplan": ["--scheduler", "dp", "--attention", "padded", "--memory-plan"],
}


# ---- servers ----------------------------------------------------------------------------


def pin_to(core: int | None):
    if core is None or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {core})


def server_and_client_cores() -> tuple[int | None, int | None]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (cores[0], cores[1]) if len(cores) >= 2 else (None, None)


def bench_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


class Server:
    """A server process; ``url`` once it answers."""

    def __init__(self, cmd: list[str], core: int | None, ready, log: Path):
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=bench_env(),
                                     preexec_fn=pin_to(core), text=True)  # fmt: skip
        self.url = ready(self, log)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _wait_for_line(server: Server, log: Path, timeout: float = 600.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if "listening on " in line:
                return line.split("listening on ", 1)[1].strip()
        if not server.alive():
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"server did not start in {timeout:.0f} s")


def _wait_for_health(url: str, timeout: float = 600.0):
    def ready(server: Server, log: Path) -> str:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not server.alive():
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server did not become healthy in {timeout:.0f} s")

    return ready


def tessera_server(system: str, folder: Path, extra_args, core, log_dir: Path) -> Server:
    cmd = [sys.executable, "-m", "tessera.cli", "serve", "--model", str(folder), "--port", "0",
           "--threads", "1", "--max-queue", "100000", *TESSERA_SYSTEMS[system], *extra_args]  # fmt: skip
    return Server(cmd, core, _wait_for_line, log_dir / f"{system}.log")


def infinity_server(folder: Path, core, log_dir: Path) -> Server:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(INFINITY_VENV / "bin" / "infinity_emb"), "v2", "--model-id", str(folder.resolve()),
           "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), "--engine", "torch",
           "--device", "cpu", "--batch-size", "32", "--no-bettertransformer"]  # fmt: skip
    return Server(cmd, core, _wait_for_health(f"http://127.0.0.1:{port}"), log_dir / "infinity.log")


def ensure_infinity(install: bool) -> str | None:
    """None when infinity-emb is ready in its venv, else why it is absent."""
    exe = INFINITY_VENV / "bin" / "infinity_emb"
    if exe.exists():
        return None
    if not install:
        return f"not installed ({INFINITY_VENV} missing; the full benchmark installs it)"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(INFINITY_VENV)], check=True, capture_output=True)
        # infinity-emb pins transformers <= 5.0, so it cannot share Tessera's environment; the
        # constraints keep its torch the CPU build Tessera runs (the same kernels for both).
        pins = INFINITY_VENV / "constraints.txt"
        pins.write_text("torch==2.13.0\n")
        pip = [str(INFINITY_VENV / "bin" / "pip"), "install", "-q", "-c", str(pins)]
        subprocess.run([*pip, "torch==2.13.0", INFINITY_PIN], check=True, capture_output=True, text=True,
                       timeout=1800)  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"could not install {INFINITY_PIN}: {str(detail).strip().splitlines()[-1:] or exc}"
    return None if exe.exists() else f"{INFINITY_PIN} installed no infinity_emb command"
