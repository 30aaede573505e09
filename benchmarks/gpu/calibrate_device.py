"""Measure the lent GPU's profile for `tessera plan`: dense matmul throughput in fp32 and
bf16, device-memory copy bandwidth, attention throughput (torch SDPA) and the memory size;
written as the profile JSON the planner reads (tessera.plan.devices).

Run from the repository root:  PYTHONPATH=src python3 benchmarks/gpu/calibrate_device.py OUT_DIR
Writes OUT_DIR/NAME.json (NAME: "measured-" + the device's name, lower case, spaces as "-")
and prints it; copy it into $TESSERA_PROFILE_DIR (or ~/.cache/tessera/devices) to plan with
`--device-profile NAME`. On a machine without a GPU it runs small sizes on the CPU (a smoke
test of the script, not a profile worth keeping).
"""

import json
import sys
import time

import torch

from tessera.plan.devices import DeviceProfile, save_profile

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _timed(fn, reps: int) -> float:
    """Best seconds of ``reps`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(reps):
        if CUDA:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if CUDA:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_flops(dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=DEVICE, dtype=dtype)
    b = torch.randn(n, n, device=DEVICE, dtype=dtype)
    return 2 * n**3 / _timed(lambda: a @ b, 10)


def copy_bandwidth(num_bytes: int) -> float:
    a = torch.empty(num_bytes // 4, device=DEVICE)
    b = torch.empty_like(a)
    return 2 * num_bytes / _timed(lambda: b.copy_(a), 10)  # read + write


def attention_flops(tokens: int, heads: int = 16, head_dim: int = 72) -> float:
    dtype = torch.bfloat16 if CUDA else torch.float32
    q, k, v = (torch.randn(1, heads, tokens, head_dim, device=DEVICE, dtype=dtype) for _ in range(3))
    seconds = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 10)
    return 4 * tokens * tokens * heads * head_dim / seconds


def main(out_dir: str) -> dict:
    n, copy, tokens = (8192, 2**30, 4096) if CUDA else (512, 2**24, 512)
    name = torch.cuda.get_device_name(0) if CUDA else "cpu-smoke"
    total = torch.cuda.get_device_properties(0).total_memory if CUDA else 0
    profile = DeviceProfile(
        name="measured-" + name.lower().replace(" ", "-"),
        fp32_flops=matmul_flops(torch.float32, n),
        bf16_flops=matmul_flops(torch.bfloat16, n) if CUDA else matmul_flops(torch.float32, n),
        memory_bandwidth=copy_bandwidth(copy),
        memory_bytes=total,
        source=f"benchmarks/gpu/calibrate_device.py on {name}, torch {torch.__version__}",
    )
    path = save_profile(profile, out_dir)
    extra = {"sdpa_flops": attention_flops(tokens), "matmul_n": n, "copy_bytes": copy, "sdpa_tokens": tokens}
    data = json.loads(path.read_text()) | {"info": extra}
    path.write_text(json.dumps(data, indent=1))
    print(json.dumps(data, indent=1))
    return data


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/devices")
