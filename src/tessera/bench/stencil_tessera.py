"""Tessera's side of `tessera bench stencil`'s Devito comparison, a process of its own like
Devito's (``stencil_devito.py``): the case's compiled stencil kernel on the field and
coefficient arrays of ``stencil_devito.pattern`` (bit for bit the arrays Devito's worker
builds), one timed round per ``run`` line on stdin, answered as a JSON line, until ``quit``.

    python stencil_tessera.py SPEC.json

SPEC: {"lib": path of the compiled kernel, "grid": [nz, ny, nx], "halo": h, "arrays": count,
"threads": t, "steps": sweeps a round}. Imports numpy and ctypes only.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from stencil_devito import pattern  # noqa: E402  (the same file Devito's venv runs)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    grid, h = tuple(spec["grid"]), spec["halo"]
    u = pattern(tuple(n + 2 * h for n in grid), 0)
    out = np.zeros_like(u)
    coefs = [pattern(grid, k + 1) for k in range(spec["arrays"])]
    ptrs = (ctypes.c_void_p * max(1, len(coefs)))(*(c.ctypes.data for c in coefs))
    lib = ctypes.CDLL(spec["lib"])
    lib.tk_init()
    fn = lib.tk_run
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    threads, steps = spec["threads"], spec["steps"]

    def sweep() -> None:
        fn(out.ctypes.data, u.ctypes.data, ptrs, threads)

    sweep()  # first touch of the output
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        for _ in range(steps):
            sweep()
        print(json.dumps({"seconds": (time.perf_counter() - t0) / steps}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
