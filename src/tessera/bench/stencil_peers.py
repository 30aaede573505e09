"""The peers `tessera bench stencil` runs beside Tessera's kernels on the same stencil:
numpy slicing, torch conv3d (constant coefficients) and Devito in its own venv (it pins
numpy below Tessera's), and the timer they share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEVITO_VENV = Path(".cache/devito-venv")
DEVITO_PIN = "devito==4.8.23"
WORKER = Path(__file__).with_name("stencil_devito.py")
TESSERA_WORKER = Path(__file__).with_name("stencil_tessera.py")


def numpy_stencil(st, u: np.ndarray, coeffs: dict, out: np.ndarray, tmp: np.ndarray) -> None:
    """Vectorised slicing, in place (no temporaries per term beyond ``tmp``)."""
    h = st.halo
    nz, ny, nx = tmp.shape
    acc = out[h:-h, h:-h, h:-h] if h else out
    acc[...] = 0
    for p in st.points:
        dz, dy, dx = p.offset
        view = u[h + dz : h + dz + nz, h + dy : h + dy + ny, h + dx : h + dx + nx]
        c = coeffs[p.coeff] if isinstance(p.coeff, str) else np.float32(p.coeff)
        np.multiply(c, view, out=tmp)
        acc += tmp


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return times


def torch_conv3d(st, u: np.ndarray, threads: int, repeats: int) -> tuple[list[float], np.ndarray]:
    """Constant coefficients as a dense (2h+1)^3 conv3d kernel (zeros off the stencil)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    h = st.halo
    w = torch.zeros((1, 1, 2 * h + 1, 2 * h + 1, 2 * h + 1))
    for p in st.points:
        w[0, 0, p.offset[0] + h, p.offset[1] + h, p.offset[2] + h] = p.coeff
    x = torch.from_numpy(u)[None, None]
    with torch.no_grad():
        times = timed(lambda: torch.nn.functional.conv3d(x, w), repeats)
        out = torch.nn.functional.conv3d(x, w)[0, 0].numpy()
    torch.set_num_threads(old)
    return times, out


def ensure_devito(install: bool) -> str | None:
    """None when Devito is ready in its venv, else why it is absent."""
    python = DEVITO_VENV / "bin" / "python"
    probe = [str(python), "-c", "import devito"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return None
    if not install:
        return f"not installed ({DEVITO_VENV} missing; the full benchmark installs it)"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(DEVITO_VENV)], check=True, capture_output=True)
        # Devito pins numpy < Tessera's, so it gets a venv of its own; it needs no torch.
        subprocess.run(
            [str(DEVITO_VENV / "bin" / "pip"), "install", "-q", DEVITO_PIN],
            check=True,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"could not install {DEVITO_PIN}: {str(detail).strip().splitlines()[-1:] or exc}"
    return None if subprocess.run(probe, capture_output=True).returncode == 0 else "devito does not import"


def _devito_spec(st, shape_name: str, grid, repeats: int, check_dir: str | None) -> dict:
    from tessera.stencil.shapes import shape_weights

    weights = shape_weights(shape_name)
    points = [
        [
            *p.offset,
            float(p.coeff) if not isinstance(p.coeff, str) else float(weights[p.offset]),
            p.coeff if isinstance(p.coeff, str) else None,
        ]
        for p in st.points
    ]
    return {"points": points, "halo": st.halo, "grid": list(grid), "repeats": repeats, "steps": 4,
            "check_dir": check_dir}  # fmt: skip


class _Worker:
    """A timing process: it prints ``ready`` once set up, then answers each ``run`` line with
    one JSON line (other output, e.g. a compiler's, is skipped)."""

    def __init__(self, cmd: list[str], env: dict, log):
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     text=True, bufsize=1)  # fmt: skip
        self._until(lambda line: line.strip() == "ready")

    def _until(self, accept) -> str:
        for line in self.proc.stdout:
            if accept(line):
                return line
        raise RuntimeError(f"{self.proc.args[1]} exited (code {self.proc.wait()}) before answering")

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self._until(lambda line: line.startswith("{")))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        self.proc.wait(timeout=600)


SETTLE_S = 0.2  # libgomp's idle threads spin far less than this before they sleep


def run_devito(st, shape_name: str, grid, threads: int, rounds: int, tessera: dict) -> dict:
    """Check Devito's answer on a small grid against the float64 reference; then Devito and
    ``tessera`` (the case's compiled kernel: {"lib": path}) each in a process of its own on
    bit-identical arrays (``stencil_devito.pattern``), ``rounds`` rounds interleaved (the order
    alternating, D T T D D T ...), each round ``steps`` sweeps of each."""
    from tessera.stencil import padded_shape, weight_arrays
    from tessera.stencil import reference as ref

    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"run_devito: rounds={rounds!r}; the paired comparison needs at least 1 round")
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        DEVITO_LANGUAGE="openmp",
        DEVITO_AUTOTUNING="aggressive",
        DEVITO_LOGGING="WARNING",
    )
    with tempfile.TemporaryDirectory() as tmp:
        small = (9, 10, 23)
        rng = np.random.default_rng(1)
        u = rng.standard_normal(padded_shape(small, st.halo), dtype=np.float32)
        co = weight_arrays(st, shape_name, small, rng=rng)
        np.save(Path(tmp) / "u.npy", u)
        for k, v in co.items():
            np.save(Path(tmp) / f"{k}.npy", v)
        spec = _devito_spec(st, shape_name, grid, rounds, tmp)
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        ours_path = Path(tmp) / "tessera.json"
        ours_path.write_text(json.dumps({**tessera, "grid": list(grid), "halo": st.halo,
                                         "arrays": len(st.arrays), "threads": threads, "steps": spec["steps"]}))
        log = (Path(tmp) / "workers.log").open("w")
        devito = ours = None
        times: dict[str, list[float]] = {"kernel_seconds": [], "wall_seconds": [], "tessera_seconds": []}
        try:
            devito = _Worker([str(DEVITO_VENV / "bin" / "python"), str(WORKER), str(spec_path), str(result_path)],
                             env, log)  # fmt: skip
            ours = _Worker([sys.executable, str(TESSERA_WORKER), str(ours_path)], env, log)
            for r in range(rounds):
                order = (devito, ours) if r % 2 == 0 else (ours, devito)
                for worker in order:
                    got = worker.run()
                    # each runs OpenMP's default wait policy, as its users do (a passive one
                    # puts threads to sleep at every barrier, which costs a kernel with many);
                    # the pause lets the one that just ran stop spinning before the other starts
                    time.sleep(SETTLE_S)
                    if worker is ours:
                        times["tessera_seconds"].append(got["seconds"])
                    else:
                        times["kernel_seconds"].append(got["kernel_seconds"])
                        times["wall_seconds"].append(got["wall_seconds"])
            for worker in (devito, ours):
                if worker is not None:
                    worker.close()
        except (RuntimeError, OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            for worker in (devito, ours):
                if worker is not None and worker.proc.poll() is None:
                    worker.proc.kill()
            log.close()
            tail = (Path(tmp) / "workers.log").read_text().strip().splitlines()
            return {"error": f"{exc}; {tail[-1] if tail else 'no output'}"}
        log.close()
        result = json.loads(result_path.read_text()) | times
        h = st.halo
        got = np.load(Path(tmp) / "out.npy")
        exact = ref.apply_float64(st, u, co)[h:-h, h:-h, h:-h]
        bound = ref.error_bound(st, u, co)[h:-h, h:-h, h:-h]
        result["check_ok"] = bool((np.abs(got - exact) <= 2 * bound).all())  # 2x: Devito may reassociate
    return result
