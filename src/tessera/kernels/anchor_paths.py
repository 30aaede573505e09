"""Which code path each torch anchor actually ran, as its libraries say it: one call of each
(kind, path, shape, threads) in a child process with ``MKL_VERBOSE=1`` and
``ONEDNN_VERBOSE=1`` (both read once, when the library starts, so never in the timing
process), under torch's profiler for the ATen operators it dispatched to. Nothing here is
timed; the benchmark's timings run without verbose output.

``python -m tessera.kernels.anchor_paths`` reads a JSON list of requests on stdin and writes
one JSON object: the libraries' banners (MKL's build and CPU line, oneDNN's ISA) and per
request the MKL functions, oneDNN primitives (kind:implementation) and ATen ops it ran.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys

from tessera.kernels.ops import Conv2dShape

_MARK = "@@tessera-path@@"
_ATEN_KEEP = re.compile(r"conv|mm|linear|mkl|addmm|matmul")


def _runner(req: dict):
    from tessera.kernels import anchors

    if req["kind"] == "gemm":
        return anchors.torch_gemm(*req["spec"], req["threads"], req["path"])
    return anchors.torch_conv(Conv2dShape(**req["spec"]), req["threads"], req["path"])


def _child(requests: list[dict]) -> None:
    import torch
    from torch.profiler import profile

    libc = ctypes.CDLL(None)
    aten = []
    for i, req in enumerate(requests):
        runner = _runner(req)  # packing and reorders happen here, outside the marked call
        with runner.threads():
            runner.call()  # the first call may build and cache primitives
            libc.fflush(None)
            os.write(1, f"\n{_MARK} begin {i}\n".encode())
            with profile() as prof:
                runner.call()
            libc.fflush(None)
            os.write(1, f"\n{_MARK} end {i}\n".encode())
        aten.append([e.name for e in prof.events() if _ATEN_KEEP.search(e.name)])
    os.write(1, f"\n{_MARK} aten {json.dumps(aten)}\n".encode())
    os.write(1, f"\n{_MARK} capability {torch.backends.cpu.get_cpu_capability()}\n".encode())


def _summary(lines: list[str]) -> dict:
    mkl = sorted({m.group(1) for ln in lines if (m := re.match(r"MKL_VERBOSE (S\w+)\(", ln))})
    onednn = []
    for ln in lines:
        parts = ln.split(",")
        if ln.startswith("onednn_verbose") and "exec" in parts and len(parts) > 6:
            at = parts.index("exec")
            name = f"{parts[at + 2]}:{parts[at + 3]}"  # primitive kind : implementation (ISA)
            if name not in onednn:
                onednn.append(name)
    return {"mkl": mkl, "onednn": onednn}


def parse(stdout: str, count: int) -> dict:
    lines = stdout.splitlines()
    banner_mkl = next(
        (ln.removeprefix("MKL_VERBOSE ") for ln in lines if re.match(r"MKL_VERBOSE (oneMKL|Intel)", ln)), None
    )
    isa = next(
        (ln.split("isa:", 1)[1] for ln in lines if ln.startswith("onednn_verbose") and ",isa:" in ln), None
    )
    out = {"mkl": banner_mkl, "onednn_isa": isa, "requests": [{} for _ in range(count)]}
    inside, seg = None, []
    for ln in lines:
        if ln.startswith(_MARK):
            _, what, arg = ln.split(" ", 2)
            if what == "begin":
                inside, seg = int(arg), []
            elif what == "end":
                out["requests"][int(arg)] = _summary(seg)
                inside = None
            elif what == "aten":
                for req, ops in zip(out["requests"], json.loads(arg), strict=True):
                    req["aten"] = list(dict.fromkeys(ops))
            elif what == "capability":
                out["cpu_capability"] = arg
        elif inside is not None:
            seg.append(ln)
    return out


def describe(req: dict) -> str:
    """One line for a table: the kernels a request ran (oneDNN's, else MKL's, and ATen's)."""
    kernels = [k for k in req.get("onednn", []) if not k.startswith("reorder:")]
    reorders = len(req.get("onednn", [])) - len(kernels)  # layout conversions inside the call
    kernels = kernels or [f"MKL {f}" for f in req.get("mkl", [])]
    aten = [
        op
        for op in req.get("aten", [])
        if op not in ("aten::conv2d", "aten::convolution", "aten::_convolution")
    ]
    extra = [f"+{reorders} reorder kinds"] if reorders else []
    return "; ".join([*kernels, *extra, *aten[-1:]]) or "unknown"


def torch_code_paths(requests: list[dict], timeout: float = 1800.0) -> dict:
    """Each request is {"kind": "gemm"|"conv", "path": a torch path, "spec": [m, n, k] or a
    Conv2dShape's fields, "threads": n}; returns parse()'s object, or {"error": why}."""
    env = {**os.environ, "MKL_VERBOSE": "1", "ONEDNN_VERBOSE": "1"}
    try:
        run = subprocess.run(
            [sys.executable, "-m", "tessera.kernels.anchor_paths"],
            input=json.dumps(requests),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the code-path child ran past {timeout:.0f} s"}
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1][:300]}
    return parse(run.stdout, len(requests))


if __name__ == "__main__":
    _child(json.loads(sys.stdin.read()))
