"""The systems `tessera bench serve` measures, as server processes: Tessera's server with
each scheduler, and infinity-emb in a virtual environment of its own (it pins
transformers <= 5.0). Each server is pinned to one core with one torch thread (and one ONNX
Runtime thread); the load generator gets the other core. Each server's real affinity is read
back from /proc and reported."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

INFINITY_VENV = Path(".cache/infinity-venv")
INFINITY_PIN = "infinity-emb[server,torch,optimum]==0.0.78"
# what pip resolves beside it and the export needs: optimum 2.1 with its ONNX half, numpy < 2
# (infinity's own pin), and the pyarrow and datasets releases that still take numpy 1
INFINITY_EXTRAS = ("optimum==2.1.0", "optimum-onnx==0.1.0", "numpy<2", "pyarrow<20", "datasets<4")
# Tessera's kernels timed at start-up for the model's shapes (kept on disk)
_TESSERA = ["--scheduler", "dp", "--kernels", "tessera", "--tuning", "measure"]
TESSERA_SYSTEMS = {
    "one_by_one": ["--scheduler", "one_by_one"],
    "fifo_padded": ["--scheduler", "fifo_padded"],
    "sort_window": ["--scheduler", "sort_window"],
    "tessera": _TESSERA,
    "tessera_torch_kernels": ["--scheduler", "dp", "--kernels", "torch"],
    # Tessera's kernels on AVX only, where the CPU has AMX (what the AMX kernel adds)
    "tessera_avx": [*_TESSERA, "--amx", "off"],
    "tessera_memplan": ["--scheduler", "dp", "--attention", "padded", "--memory-plan"],
    # two cores: one engine worker of two threads, or two workers of one thread each
    "tessera_1x2": [*_TESSERA, "--workers", "1", "--threads", "2"],
    "tessera_2x1": [*_TESSERA, "--workers", "2", "--threads", "1"],
}
# infinity-emb's CPU engines: torch (its own padded batches on torch's kernels) and optimum
# (the model exported to ONNX and run by ONNX Runtime, what its docs recommend on CPU);
# ``infinity_optimum_2cores``: the same with ONNX Runtime's default thread pool, on two cores
INFINITY_ENGINES = {
    "infinity_torch": "torch",
    "infinity_optimum": "optimum",
    "infinity_optimum_2cores": "optimum",
}
# ONNX Runtime's intra-op pool defaults to one thread a physical core and pins each worker to
# a core of its own, whatever the process's affinity: pinned to core 0 it still ran on both
# (10.0 against 19.5 ms a 128-token request here). In the one-core phases its pool is set to
# one thread (ORT's own knob, SessionOptions.intra_op_num_threads) by this sitecustomize,
# which infinity's process imports at start-up when TESSERA_BENCH_ORT_THREADS is set.
ORT_THREADS_SITE = """import os

_threads = os.environ.get("TESSERA_BENCH_ORT_THREADS")
if _threads:
    import onnxruntime as _ort

    class _Session(_ort.InferenceSession):
        def __init__(self, path_or_bytes, sess_options=None, *args, **kwargs):
            options = sess_options or _ort.SessionOptions()
            options.intra_op_num_threads = int(_threads)
            options.inter_op_num_threads = 1
            super().__init__(path_or_bytes, options, *args, **kwargs)

    _ort.InferenceSession = _Session
"""


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

    def __init__(self, cmd: list[str], core: int | None, ready, log: Path, cwd: Path | None = None,
                 env: dict | None = None):  # fmt: skip
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**bench_env(), **(env or {})},
                                     preexec_fn=pin_to(core), text=True, cwd=cwd)  # fmt: skip
        self.url = ready(self, log)

    def cores(self) -> dict:
        """The cores the server's threads may run on (their affinity, as the kernel reports
        it) and its thread count: what the server really had, whatever it was asked."""
        allowed, threads = set(), 0
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                status = (task / "status").read_text()
            except OSError:
                continue
            threads += 1
            for line in status.splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    allowed |= _cpu_list(line.split(":", 1)[1].strip())
        return {"cpus_allowed": sorted(allowed), "threads": threads}

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


def _cpu_list(text: str) -> set[int]:
    out = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


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


def start_server(system: str, batch: int | None, folder: Path, extra_args, core, log_dir: Path) -> Server:
    """``system`` serving ``folder`` on ``core``; ``batch``: its batch-size knob (None: default)."""
    label = system if batch is None else f"{system}-b{batch}"
    if system in INFINITY_ENGINES:
        ort_threads = None if system.endswith("_2cores") else 1
        return infinity_server(folder, core, log_dir / f"{label}.log", INFINITY_ENGINES[system], batch or 32,
                               ort_threads)  # fmt: skip
    knob = [] if batch is None else ["--max-batch-size", str(batch)]
    cmd = [sys.executable, "-m", "tessera.cli", "serve", "--model", str(folder), "--port", "0",
           "--threads", "1", "--max-queue", "100000", *TESSERA_SYSTEMS[system], *knob, *extra_args]  # fmt: skip
    return Server(cmd, core, _wait_for_line, log_dir / f"{label}.log")


def onnx_folder(folder: Path) -> Path:
    """``folder`` exported to ONNX beside it (``<folder>-onnx/model.onnx``, once), for infinity's
    optimum engine, which looks for an ONNX file and does not export one itself. The export is
    optimum's own (``optimum-cli export onnx``, feature extraction) from infinity's venv, with
    ONNX Runtime's graph optimizer at level O2: fused attention, skip-LayerNorm and bias-GELU
    (exact), fp32 -- what infinity asks ONNX Runtime for when it loads a model (level 99, no
    GELU approximation), which infinity 0.0.78 cannot do itself with optimum 2.x (it passes a
    keyword optimum removed, logs it, and runs the graph unoptimized)."""
    out = folder.parent / f"{folder.name}-onnx"
    if (out / "model.onnx").exists():
        return out
    partial = folder.parent / f"{folder.name}-onnx.partial"
    cmd = [str(INFINITY_VENV / "bin" / "optimum-cli"), "export", "onnx", "--model", str(folder), "--task",
           "feature-extraction", "--optimize", "O2", str(partial)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=bench_env(), timeout=1800)
    if done.returncode != 0 or not (partial / "model.onnx").exists():
        raise RuntimeError(f"ONNX export failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    partial.rename(out)
    return out


def infinity_server(
    folder: Path, core, log: Path, engine: str, batch: int, ort_threads: int | None = 1
) -> Server:
    """``ort_threads``: ONNX Runtime's intra-op threads (None: its default pool)."""
    model_id, cwd, env = str(folder.resolve()), None, {}
    if ort_threads is not None:
        site = INFINITY_VENV.resolve() / "ort-threads"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(ORT_THREADS_SITE)
        env = {"TESSERA_BENCH_ORT_THREADS": str(ort_threads), "PYTHONPATH": str(site)}
    if engine == "optimum":
        # infinity 0.0.78 hands optimum 2.x the ONNX file's path as globbed under the model id,
        # which optimum takes relative to the model folder: started inside the folder with
        # model id ".", the two agree
        model_id, cwd = ".", onnx_folder(folder).resolve()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(INFINITY_VENV.resolve() / "bin" / "infinity_emb"), "v2", "--model-id", model_id,
           "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), "--engine", engine,
           "--device", "cpu", "--batch-size", str(batch), "--no-bettertransformer", "--pooling-method", "mean"]  # fmt: skip
    return Server(cmd, core, _wait_for_health(f"http://127.0.0.1:{port}"), log.resolve(), cwd=cwd, env=env)


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
        subprocess.run([*pip, "torch==2.13.0", INFINITY_PIN, *INFINITY_EXTRAS], check=True, capture_output=True, text=True,
                       timeout=1800)  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"could not install {INFINITY_PIN}: {str(detail).strip().splitlines()[-1:] or exc}"
    return None if exe.exists() else f"{INFINITY_PIN} installed no infinity_emb command"
