"""`tessera bench dit`: serial vs every parallel inference method, in one run.

Here a "device" is one CPU core: serial runs in 1 process with 1 thread, each method in
2 ranks with 1 thread each (gloo), so a speedup means what it means between one GPU and
two. Every layout samples the same model from the same noise; the timed run follows an
untimed 1-step run (start-up costs out of the figure).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tessera.bench.dit_bytes import Dims, formula_bytes, measured_bytes
from tessera.bench.harness import BenchResult, current_rss_bytes, peak_rss_bytes
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_sample
from tessera.diffusion.pipefusion import release_other_stages
from tessera.models.dit import DiT, DiTConfig
from tessera.runtime import spawn

# PixArt-alpha's layout at a third of its depth and width: 4 latent channels, 2x2 patches.
BENCH_MODEL = DiTConfig(
    image_size=64, in_channels=4, patch_size=2, hidden_size=384, depth=12, num_heads=6, num_classes=10
)
GUIDANCE = 4.0

LAYOUTS: dict[str, ParallelConfig] = {
    "serial": ParallelConfig(),
    "pipefusion": ParallelConfig(pipefusion_degree=2, num_patches=4, warmup_steps=1),
    "ulysses": ParallelConfig(ulysses_degree=2),
    "ring": ParallelConfig(ring_degree=2),
    "distrifusion": ParallelConfig(distrifusion_degree=2, warmup_steps=1),
    "tensor_parallel": ParallelConfig(tp_degree=2),
    "cfg_parallel": ParallelConfig(cfg_parallel=True),
}


@dataclass(frozen=True, kw_only=True)
class DitBenchPlan:
    sizes: tuple[int, ...]  # latent height = width
    steps: int
    batch: int = 1
    repeats: int = 1  # timed runs per layout; the fastest counts (the least disturbed)


FULL = DitBenchPlan(sizes=(32, 48, 64), steps=20, repeats=2)
QUICK = DitBenchPlan(sizes=(16, 32), steps=6)


def bench_model() -> DiT:
    """The benchmark DiT with random weights moved off adaLN-zero's start (where every
    block is the identity and any two methods would agree trivially)."""
    torch.manual_seed(0)
    model = DiT(BENCH_MODEL).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _rank_run(config: ParallelConfig, size: int, steps: int, batch: int, repeats: int = 1) -> dict:
    model = bench_model()
    mesh = config.build_mesh()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if config.method == "pipefusion":
        param_bytes = release_other_stages(model, config, mesh)
    elif config.method == "tp":
        param_bytes = _tp_param_bytes(model, config.tp_degree)
    labels = torch.arange(batch) % BENCH_MODEL.num_classes
    kw = dict(config=config, mesh=mesh, height=size, width=size, guidance_scale=GUIDANCE, seed=0)
    parallel_sample(model, labels, num_steps=1, **kw)
    rss_before = current_rss_bytes()
    times = []
    for _ in range(repeats):
        mesh.comm.ledger.reset()
        mesh.comm.barrier()
        began = time.perf_counter()
        latent = parallel_sample(model, labels, num_steps=steps, **kw)
        times.append(time.perf_counter() - began)
    return {
        "seconds": min(times),
        "all_seconds": times,
        "ledger": mesh.comm.ledger.snapshot(),
        "param_bytes": param_bytes,
        "peak_rss": peak_rss_bytes(),
        "sampling_extra": max(0, peak_rss_bytes() - rss_before),
        "latent": latent if mesh.global_rank == 0 else None,
    }


def _tp_param_bytes(model: DiT, degree: int) -> int:
    """What a rank needs under TP: attention/MLP weights split, the rest replicated."""
    total = 0
    for name, p in model.named_parameters():
        split = (".attn." in name or ".mlp." in name) and not name.endswith(("to_out.bias", "fc2.bias"))
        total += p.numel() * p.element_size() // (degree if split else 1)
    return total


def _measure(name: str, size: int, plan: DitBenchPlan) -> tuple[dict, torch.Tensor]:
    """One layout at one size: its row (without the ratios to serial) and final latent."""
    config = LAYOUTS[name]
    ranks = spawn(
        _rank_run, config.world_size, config, size, plan.steps, plan.batch, plan.repeats, timeout_s=1800
    )
    dims = Dims(
        steps=plan.steps,
        layers=BENCH_MODEL.depth,
        tokens=(size // BENCH_MODEL.patch_size) ** 2,
        hidden=BENCH_MODEL.hidden_size,
        batch=plan.batch,
        latent_elems=BENCH_MODEL.in_channels * size * size,
        guidance=True,
    )
    measured, formula = measured_bytes([r["ledger"] for r in ranks]), formula_bytes(config, dims)
    row = {
        "method": name,
        "size": f"{size}x{size}",
        "tokens": dims.tokens,
        "ranks": config.world_size,
        "seconds": round(max(r["seconds"] for r in ranks), 3),  # the slowest rank ends the run
        "all_seconds": [round(max(r["all_seconds"][i] for r in ranks), 3) for i in range(plan.repeats)],
        "bytes_per_step": measured // plan.steps,
        "formula_bytes_per_step": formula // plan.steps,
        "bytes_rel_error": abs(measured - formula) / formula if formula else float(measured != 0),
        "param_mib_per_rank": round(max(r["param_bytes"] for r in ranks) / 2**20, 2),
        "peak_rss_mib_per_rank": round(max(r["peak_rss"] for r in ranks) / 2**20, 1),
        "sampling_extra_mib_per_rank": round(max(r["sampling_extra"] for r in ranks) / 2**20, 1),
    }
    return row, ranks[0]["latent"]


COLUMNS = [
    "method",
    "size",
    "ranks",
    "seconds",
    "speedup",
    "bytes_per_step",
    "formula_bytes_per_step",
    "bytes_rel_error",
    "param_mib_per_rank",
    "sampling_extra_mib_per_rank",
    "rel_diff_vs_serial",
]


def run_dit_bench(plan: DitBenchPlan, digits_model: Path | None, progress: bool = True) -> BenchResult:
    rows, serial = [], {}
    jobs = [(size, name) for size in plan.sizes for name in LAYOUTS]  # serial first at each size
    for size, name in tqdm(jobs, desc="bench dit", disable=not progress):
        row, latent = _measure(name, size, plan)
        if name == "serial":
            serial[size] = (row["seconds"], latent)
        base_seconds, base_latent = serial[size]
        row["speedup"] = round(base_seconds / row["seconds"], 3)
        row["rel_diff_vs_serial"] = float((latent - base_latent).norm() / base_latent.norm())
        rows.append(row)
    largest = f"{plan.sizes[-1]}x{plan.sizes[-1]}"
    headline = {
        "pipefusion_speedup": next(
            r["speedup"] for r in rows if r["method"] == "pipefusion" and r["size"] == largest
        ),
        "largest_size": largest,
        "max_bytes_rel_error": max(r["bytes_rel_error"] for r in rows),
    }
    extra = {
        "plan": {
            "sizes": plan.sizes,
            "steps": plan.steps,
            "batch": plan.batch,
            "repeats": plan.repeats,
            "guidance": GUIDANCE,
        },
        "model": BENCH_MODEL.to_dict(),
        "layouts": {k: v.describe() for k, v in LAYOUTS.items()},
    }
    notes = [
        "serial: 1 process x 1 thread; every method: 2 gloo ranks x 1 thread (one core = one device)",
        f"seconds: the fastest of {plan.repeats} timed run(s) after an untimed 1-step run (all_seconds in the JSON)",
        "bytes: summed over ranks, receives not added; formulas in src/tessera/bench/dit_bytes.py",
        "rel_diff_vs_serial: ||x - x_serial|| / ||x_serial|| of the final latent (random weights: stale "
        "K/V methods are far from their trained-model fidelity here; see the fidelity table)",
        "peak_rss includes the ~0.3 GB Python + torch runtime; sampling_extra is the rise during sampling",
    ]
    if digits_model is not None:
        extra["fidelity"] = run_fidelity(digits_model, steps=20, per_digit=10 if plan is FULL else 4)
        headline |= {f"psnr_{row['method']}": row["psnr_db"] for row in extra["fidelity"]}
    else:
        notes.append("fidelity skipped: no trained digits checkpoint (run `make demo` first)")
    return BenchResult(name="dit", headline=headline, rows=rows, columns=COLUMNS, notes=notes, extra=extra)


def _fidelity_rank(
    model_dir: str, labels: torch.Tensor, configs: dict[str, ParallelConfig], steps: int
) -> dict:
    from tessera.train.checkpoint import load_tensors, read_config

    model = DiT(DiTConfig.from_dict(read_config(model_dir)["model"]))
    model.load_state_dict(load_tensors(Path(model_dir) / "model.safetensors"))
    model.eval()
    size = model.config.image_size
    return {
        name: parallel_sample(
            model, labels, config=config, height=size, width=size, num_steps=steps, guidance_scale=2.0, seed=0
        )
        for name, config in configs.items()
    }


FIDELITY_LAYOUTS = {
    "serial": ParallelConfig(),
    "pipefusion_warmup1": ParallelConfig(pipefusion_degree=2, num_patches=4, warmup_steps=1),
    "pipefusion_warmup0": ParallelConfig(pipefusion_degree=2, num_patches=4, warmup_steps=0),
    "distrifusion_warmup1": ParallelConfig(distrifusion_degree=2, warmup_steps=1),
}


def psnr(x: torch.Tensor, reference: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB for images in [-1, 1] (peak-to-peak 2)."""
    mse = ((x.clamp(-1, 1) - reference.clamp(-1, 1)) ** 2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(4.0 / mse)).item()


def run_fidelity(model_dir: Path, *, steps: int, per_digit: int) -> list[dict]:
    """PSNR against serial sampling from the same noise, and class accuracy, on the
    trained digits DiT (2 ranks for the parallel layouts)."""
    from tessera.data.digits import digit_classifier

    labels = torch.arange(10).repeat_interleave(per_digit)
    serial = spawn(_fidelity_rank, 1, str(model_dir), labels, {"serial": FIDELITY_LAYOUTS["serial"]}, steps)[
        0
    ]["serial"]
    parallel = {k: v for k, v in FIDELITY_LAYOUTS.items() if k != "serial"}
    outputs = spawn(_fidelity_rank, 2, str(model_dir), labels, parallel, steps)[0] | {"serial": serial}
    clf = digit_classifier()
    return [
        {
            "method": name,
            "psnr_db": round(psnr(images, serial), 2),
            "class_accuracy": clf.accuracy(images, labels),
            "samples": len(labels),
            "steps": steps,
        }
        for name, images in outputs.items()
    ]


def plot_dit(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = sorted({r["tokens"] for r in result.rows})
    for method in LAYOUTS:
        if method == "serial":
            continue
        points = sorted((r["tokens"], r["speedup"]) for r in result.rows if r["method"] == method)
        ax_speed.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    ax_speed.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax_speed.axhline(2.0, color="grey", linestyle=":", linewidth=1)
    ax_speed.set(
        xlabel="image tokens", ylabel="speedup over serial (2 ranks)", title="Wall-time speedup", xticks=sizes
    )
    ax_speed.legend(fontsize=8)
    largest = [r for r in result.rows if r["tokens"] == sizes[-1] and r["method"] != "serial"]
    names = [r["method"] for r in largest]
    xs = range(len(largest))
    ax_bytes.bar(
        [x - 0.2 for x in xs], [r["bytes_per_step"] / 2**20 for r in largest], width=0.4, label="measured"
    )
    ax_bytes.bar(
        [x + 0.2 for x in xs],
        [r["formula_bytes_per_step"] / 2**20 for r in largest],
        width=0.4,
        label="formula",
    )
    ax_bytes.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
    ax_bytes.set(ylabel="MiB per step, all ranks", title=f"Communication at {largest[0]['size']} latent")
    ax_bytes.set_yscale("log")
    ax_bytes.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
