"""Devito on the same equation as Tessera's stencil kernels, run in Devito's own venv
(.cache/devito-venv: Devito 4.8.23 pins numpy below the version Tessera's venv holds).
This file imports neither Tessera nor torch: `tessera bench stencil` runs it as a script.

    python stencil_devito.py SPEC.json RESULT.json

SPEC: {"points": [[dz, dy, dx, weight, array-or-null], ...], "halo": h, "grid": [nz, ny, nx],
"repeats": n (0: check only), "steps": sweeps per timed apply, "check_dir": folder or null}.
With ``check_dir`` it first applies the operator to the small inputs there and saves out.npy,
so the caller can check that Devito computes the same sum. Then it builds the full grid's
operator on arrays from ``pattern`` (bit for bit the arrays Tessera's worker,
``stencil_tessera.py``, builds) with
opt='advanced' and autotuning='aggressive' (Devito's recommendation for performance;
DEVITO_LANGUAGE=openmp and OMP_NUM_THREADS come from the caller's environment), prints
``ready`` and answers each ``run`` line on stdin with one timed apply as a JSON line (its
own operator timer and the wall time, per sweep), until ``quit``: the caller alternates
rounds of the two processes (this VM's bandwidth moves within seconds, so only rounds timed
side by side compare).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def build(spec: dict, grid_shape):
    """u(t+1) = sum_p c_p u(t)(x + p): one sweep of the stencil per time step. The time loop is
    there because Devito autotunes only operators that have one; the caller divides by the
    steps it runs."""
    from devito import Eq, Function, Grid, Operator, TimeFunction

    h = spec["halo"]
    grid = Grid(shape=tuple(grid_shape), dtype=np.float32)
    d0, d1, d2 = grid.dimensions
    t = grid.stepping_dim
    u = TimeFunction(name="u", grid=grid, space_order=h, time_order=1, dtype=np.float32)
    coeffs, expr = {}, 0
    for dz, dy, dx, weight, name in spec["points"]:
        if name is None:
            c = float(np.float32(weight))
        else:
            if name not in coeffs:
                coeffs[name] = Function(name=name, grid=grid, space_order=0, dtype=np.float32)
            c = coeffs[name]
        expr = expr + c * u[t, d0 + dz, d1 + dy, d2 + dx]
    op = Operator([Eq(u.forward, expr)], opt="advanced")
    return op, u, coeffs


def pattern(shape, salt: int) -> np.ndarray:
    """Deterministic float32 values in [-0.5, 0.5) (field, salt 0) or [0.5, 1.5) (coefficient
    arrays, salt 1, 2, ...): integer arithmetic and one correctly rounded division, so Devito's
    worker (its own numpy 1.x) and Tessera's (numpy 2.x) build bit-identical arrays without
    passing gigabytes through files."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.int64)
    values = ((i * 7919 + salt * 104729) % 1009) / 1009.0 + (0.5 if salt else -0.5)
    return values.astype(np.float32).reshape(shape)


def _fill(u, coeffs, arrays: dict) -> None:
    full = u.data_with_halo[0]
    pad = (full.shape[0] - arrays["u"].shape[0]) // 2  # Devito's halo may be wider than ours
    full[:] = 0
    full[pad:full.shape[0] - pad, pad:full.shape[1] - pad, pad:full.shape[2] - pad] = arrays["u"]
    for name, f in coeffs.items():
        f.data[:] = arrays[name]


def check(spec: dict, folder: Path) -> None:
    u_small = np.load(folder / "u.npy")
    h = spec["halo"]
    shape = tuple(n - 2 * h for n in u_small.shape)
    op, u, coeffs = build(spec, shape)
    arrays = {"u": u_small} | {n: np.load(folder / f"{n}.npy") for n in coeffs}
    _fill(u, coeffs, arrays)
    op.apply(time_m=0, time_M=0)
    np.save(folder / "out.npy", np.asarray(u.data[1]))


def serve(spec: dict) -> dict:
    """Build and autotune on the caller's arrays, then one timed apply per ``run`` line."""
    shape, steps = tuple(spec["grid"]), spec.get("steps", 4)
    op, u, coeffs = build(spec, shape)
    h = spec["halo"]
    padded = tuple(n + 2 * h for n in shape)
    arrays = {"u": pattern(padded, 0)} | {n: pattern(shape, k + 1) for k, n in enumerate(coeffs)}
    _fill(u, coeffs, arrays)
    del arrays
    began = time.perf_counter()
    op.apply(time_m=0, time_M=steps - 1, autotune="aggressive")  # compiles, autotunes the blocks
    setup = time.perf_counter() - began
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        summary = op.apply(time_m=0, time_M=steps - 1)
        wall = (time.perf_counter() - t0) / steps
        kernel = sum(entry.time for entry in summary.values()) / steps
        print(json.dumps({"kernel_seconds": kernel, "wall_seconds": wall}), flush=True)
    return {"setup_seconds": setup, "steps": steps}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    if spec.get("check_dir"):
        check(spec, Path(spec["check_dir"]))
    result = serve(spec) if spec.get("repeats", 0) > 0 else {}
    import devito
    from devito import configuration

    result["devito"] = devito.__version__
    cc = configuration["compiler"]  # the code path it ran: its platform, language and compiler flags
    result["code_path"] = (f"platform {configuration['platform']}, {configuration['language']}, "
                           f"{type(cc).__name__} {' '.join(getattr(cc, 'cflags', []))}")  # fmt: skip
    Path(argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
