"""Devito on the same equation as Tessera's stencil kernels, run in Devito's own venv
(.cache/devito-venv: Devito 4.8.23 pins numpy below the version Tessera's venv holds).
This file imports neither Tessera nor torch: `tessera bench stencil` runs it as a script.

    python stencil_devito.py SPEC.json RESULT.json

SPEC: {"points": [[dz, dy, dx, weight, array-or-null], ...], "halo": h, "grid": [nz, ny, nx],
"repeats": n, "steps": sweeps per timed apply, "check_dir": folder or null, "tessera": null or
{"lib": path, "padded": [pz, py, px], "arrays": [names], "threads": t}}. With ``check_dir`` it first applies the operator
to the small inputs there (u.npy with its halo, one .npy per coefficient array) and saves
out.npy, so the caller can check that Devito computes the same sum. Then it times the full
grid: opt='advanced' and autotuning='aggressive' (Devito's recommendation for performance;
DEVITO_LANGUAGE=openmp and OMP_NUM_THREADS come from the caller's environment). With
``tessera``, each timed apply alternates with one sweep of Tessera's compiled kernel for
the same stencil (loaded by path, on arrays of its own layout): this VM's bandwidth moves
within seconds, so only sweeps timed side by side compare the two.
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


def _tessera(spec: dict, shape):
    """One sweep of the caller's compiled Tessera kernel on random arrays of its layout, or None."""
    import ctypes

    cfg = spec.get("tessera")
    if not cfg:
        return None
    lib = ctypes.CDLL(cfg["lib"])
    lib.tk_init()
    fn = lib.tk_run
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    rng = np.random.default_rng(3)
    u = rng.standard_normal(tuple(cfg["padded"]), dtype=np.float32)
    out = np.zeros_like(u)
    coefs = [(0.5 + rng.random(shape, dtype=np.float32)) for _ in cfg["arrays"]]
    ptrs = (ctypes.c_void_p * max(1, len(coefs)))(*(c.ctypes.data for c in coefs))

    def sweep() -> None:
        fn(out.ctypes.data, u.ctypes.data, ptrs, cfg["threads"])

    sweep.arrays = coefs  # ptrs holds bare addresses: the arrays must live as long as the sweep
    return sweep


def timed(spec: dict) -> dict:
    shape, steps = tuple(spec["grid"]), spec.get("steps", 4)
    op, u, coeffs = build(spec, shape)
    rng = np.random.default_rng(0)
    u.data_with_halo[:] = rng.standard_normal(u.data_with_halo.shape, dtype=np.float32) * 1e-3
    for f in coeffs.values():
        f.data[:] = rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
    began = time.perf_counter()
    op.apply(time_m=0, time_M=steps - 1, autotune="aggressive")  # compiles, autotunes the blocks
    setup = time.perf_counter() - began
    ours = _tessera(spec, shape)
    if ours:
        ours()  # warm-up: first touch
    walls, kernels, tessera = [], [], []
    for _ in range(spec["repeats"]):
        if ours:
            t0 = time.perf_counter()
            ours()
            tessera.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        summary = op.apply(time_m=0, time_M=steps - 1)
        walls.append((time.perf_counter() - t0) / steps)
        kernels.append(sum(entry.time for entry in summary.values()) / steps)
    return {"wall_seconds": walls, "kernel_seconds": kernels, "setup_seconds": setup, "steps": steps,
            "tessera_seconds": tessera}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    if spec.get("check_dir"):
        check(spec, Path(spec["check_dir"]))
    result = timed(spec) if spec.get("repeats", 0) > 0 else {}
    import devito

    result["devito"] = devito.__version__
    Path(argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
