"""One prepared run for a lent GPU: Tessera's CUDA (and, where possible, NCCL) path of
PipeFusion and Ulysses, checked against serial sampling, with timings.

Run from the repository root:  PYTHONPATH=src python3 benchmarks/gpu/cuda_check.py OUT_DIR
Writes OUT_DIR/cuda_check.json and prints a short table. Runs on CPU too (smoke test).
"""

import json
import sys
import time
import traceback

import torch

from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_sample
from tessera.diffusion.sampler import sample
from tessera.models.dit import DiT, DiTConfig
from tessera.runtime import spawn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = DiTConfig(
    image_size=32, in_channels=4, patch_size=2, hidden_size=256, depth=6, num_heads=8, num_classes=10
)
# PixArt-alpha's transformer shape: 28 layers, hidden 1152, 16 heads, 2x2 patches, 4 latent channels.
PIXART = DiTConfig(
    image_size=128, in_channels=4, patch_size=2, hidden_size=1152, depth=28, num_heads=16, num_classes=10
)


def build(config: DiTConfig, dtype=torch.float32, device=DEVICE) -> DiT:
    torch.manual_seed(0)
    model = DiT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.to(device=device, dtype=dtype).eval()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat=2):
    fn()  # warm-up: kernels, allocator
    sync()
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - began)
    return min(times)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def exactness_single_process() -> dict:
    model = build(SMALL)
    labels = torch.tensor([1, 7])
    kw = dict(height=32, width=32, num_steps=4, guidance_scale=3.0, seed=0)
    serial = sample(
        model, labels, image_shape=(4, 32, 32), num_steps=4, guidance_scale=3.0, seed=0, progress=False
    )
    out = {}
    for name, config in {
        "pipefusion_patches4_warmup_all": ParallelConfig(num_patches=4, warmup_steps=4),
        "pipefusion_patches4_warmup1": ParallelConfig(num_patches=4, warmup_steps=1),
        "ulysses1": ParallelConfig(ulysses_degree=1),
    }.items():
        out[name] = rel(parallel_sample(model, labels, config=config, **kw), serial)
    return out


def pixart_timings() -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    sizes = (64, 128) if DEVICE == "cuda" else (16,)
    model = build(PIXART if DEVICE == "cuda" else SMALL, dtype=dtype)
    labels = torch.tensor([3])
    for size in sizes:
        for name, config in {
            "serial": ParallelConfig(),
            "pipefusion_1stage_4patches": ParallelConfig(num_patches=4, warmup_steps=1),
        }.items():

            def run(config=config, size=size):
                return parallel_sample(
                    model,
                    labels,
                    config=config,
                    height=size,
                    width=size,
                    num_steps=8,
                    guidance_scale=4.0,
                    seed=0,
                )

            seconds = timed(run)
            rows.append(
                {
                    "layout": name,
                    "latent": f"{size}x{size}",
                    "dtype": str(dtype),
                    "steps": 8,
                    "seconds": round(seconds, 4),
                    "seconds_per_step": round(seconds / 8, 5),
                }
            )
    return rows


def _nccl_rank(config: ParallelConfig) -> float:
    model = build(SMALL, device=f"cuda:{torch.cuda.current_device()}" if DEVICE == "cuda" else "cpu")
    labels = torch.tensor([1, 7])
    out = parallel_sample(
        model, labels, config=config, height=32, width=32, num_steps=4, guidance_scale=3.0, seed=0
    )
    ref = sample(
        model, labels, image_shape=(4, 32, 32), num_steps=4, guidance_scale=3.0, seed=0, progress=False
    )
    return rel(out, ref)


def multi_rank() -> dict:
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    out = {"backend": backend, "gpus": torch.cuda.device_count()}
    for name, config in {
        "pipefusion2_warmup_all": ParallelConfig(pipefusion_degree=2, num_patches=4, warmup_steps=4),
        "ulysses2": ParallelConfig(ulysses_degree=2),
    }.items():
        try:
            out[name] = max(
                spawn(_nccl_rank, 2, config, backend=backend, timeout_s=120, collective_timeout_s=60)
            )
        except Exception as exc:  # record, do not stop the rest of the lease
            out[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return out


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    report = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
    }
    for name, fn in [
        ("exactness", exactness_single_process),
        ("timings", pixart_timings),
        ("multi_rank", multi_rank),
    ]:
        began = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:
            report[name] = "failed: " + traceback.format_exc()[-800:]
        print(f"{name} done in {time.perf_counter() - began:.1f}s", flush=True)
    with open(f"{out_dir}/cuda_check.json", "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
