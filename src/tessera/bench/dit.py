"""`tessera bench dit`: serial vs every parallel inference method, in one run.

Here a "device" is one CPU core: the serial baseline is one process with one thread, each
method 2 ranks with one thread each (gloo), so a speedup means what it means between one
GPU and two. Every layout samples the same model from the same noise; the timed runs
follow an untimed 1-step run (start-up costs out of the figure).

With ``links``, the methods run again at the largest size with every transfer taking the
time it would take on each named link (``runtime.link``), scaled to the balance between
compute and link a real device would see: a CPU core computes far slower than a GPU, so
the link's bandwidth is multiplied (and its latency divided) by this core's measured
fp32 matmul rate over the named GPU's (``link_device``, default the L40 of the PipeFusion
paper's testbed). The emulated waits are reported apart from the rest of the time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tessera.bench.harness import BenchResult, matmul_peak_flops
from tessera.diffusion.comm_bytes import Dims, formula_bytes, measured_bytes
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_sample
from tessera.diffusion.pipefusion import release_other_stages
from tessera.memory.track import peak_resident_bytes, resident_bytes
from tessera.models.dit import DiT, DiTConfig
from tessera.plan.devices import device_named
from tessera.runtime import spawn
from tessera.runtime.link import Link, link_named

# PixArt-alpha's layout at a third of its depth and width: 4 latent channels, 2x2 patches.
BENCH_MODEL = DiTConfig(
    image_size=64, in_channels=4, patch_size=2, hidden_size=384, depth=12, num_heads=6, num_classes=10
)
GUIDANCE = 4.0

LAYOUTS: dict[str, ParallelConfig] = {
    "serial": ParallelConfig(),
    "pipefusion": ParallelConfig(pipefusion=2, patches=4, warmup_steps=1),
    "ulysses": ParallelConfig(ulysses=2),
    "ring": ParallelConfig(ring=2),
    "distrifusion": ParallelConfig(distrifusion=2, warmup_steps=1),
    "tensor_parallel": ParallelConfig(tp=2),
    "cfg_parallel": ParallelConfig(cfg_parallel=True),
}
LABELS = {"serial": "serial: 1 process x 1 thread"} | {
    name: f"{config.describe()}: {config.world_size} ranks x 1 thread"
    for name, config in LAYOUTS.items()
    if name != "serial"
}


@dataclass(frozen=True, kw_only=True)
class DitBenchPlan:
    sizes: tuple[int, ...]  # latent height = width
    steps: int
    batch: int = 1
    repeats: int = 1  # timed runs per layout, interleaved with nothing else in their processes
    links: tuple[str, ...] = ()  # emulated links for the runs at the largest size
    link_steps: int = 4  # sampling steps of each emulated-link run (time per step is what counts)
    link_device: str = "l40"  # whose compute-to-link balance the emulated links keep
    fidelity_per_digit: int = 4

    def __post_init__(self) -> None:
        for name in self.links:
            link_named(name)  # an unknown link fails before anything runs
        device_named(self.link_device)


FULL = DitBenchPlan(
    sizes=(32, 48, 64), steps=20, repeats=3, links=("pcie4", "ethernet-25g"), fidelity_per_digit=10
)
QUICK = DitBenchPlan(sizes=(16, 32), steps=6, links=("pcie4",), link_steps=2)


def bench_model() -> DiT:
    """The benchmark DiT with random weights moved off adaLN-zero's start (where every
    block is the identity and any two methods would agree trivially)."""
    torch.manual_seed(0)
    model = DiT(BENCH_MODEL).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def held_parameter_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes this rank holds: released (meta) tensors hold none, a tensor-parallel
    DTensor holds its local shard; shared storages count once."""
    seen, total = set(), 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.device.type == "meta" or local.untyped_storage().data_ptr() in seen:
            continue
        seen.add(local.untyped_storage().data_ptr())
        total += local.untyped_storage().nbytes()
    return total


def _set_up(model: DiT, config: ParallelConfig, mesh) -> None:
    """What a user's run does before sampling: PipeFusion frees other stages' blocks,
    tensor parallel shards the split weights (they stay sharded for every run)."""
    if config.method == "pipefusion":
        release_other_stages(model, config, mesh)
    elif config.method == "tp":
        from tessera.parallel.tp_plans import apply_tp, plan_for

        apply_tp(model, plan_for(model), mesh.device_mesh["tp"], config.tp, src_data_rank=None)


def _timed(model, labels, mesh, kw: dict, steps: int) -> tuple[float, torch.Tensor]:
    mesh.comm.ledger.reset()
    mesh.comm.barrier()
    began = time.perf_counter()
    latent = parallel_sample(model, labels, num_steps=steps, **kw)
    return time.perf_counter() - began, latent


def _rank_run(config: ParallelConfig, size: int, plan: DitBenchPlan, links: dict[str, Link]) -> dict:
    rss_before_model = resident_bytes()
    model, mesh = bench_model(), config.build_mesh()
    _set_up(model, config, mesh)
    held, setup_rss = held_parameter_bytes(model), resident_bytes() - rss_before_model
    labels = torch.arange(plan.batch) % BENCH_MODEL.num_classes
    kw = dict(config=config, mesh=mesh, height=size, width=size, guidance_scale=GUIDANCE, seed=0)
    parallel_sample(model, labels, num_steps=1, **kw)
    rss_before = resident_bytes()
    times = []
    for _ in range(plan.repeats):
        seconds, latent = _timed(model, labels, mesh, kw, plan.steps)
        times.append(seconds)
    out = {
        "all_seconds": times,
        "ledger": mesh.comm.ledger.snapshot(),
        "param_bytes": held,
        "setup_rss": setup_rss,
        "peak_rss": peak_resident_bytes(),
        "sampling_extra": max(0, peak_resident_bytes() - rss_before),
        "latent": latent if mesh.global_rank == 0 else None,
        "links": {},
    }
    for name, link in links.items():
        mesh.comm.emulate(link)
        seconds, _ = _timed(model, labels, mesh, kw, plan.link_steps)
        out["links"][name] = {"seconds": seconds, "emulated_s": mesh.comm.ledger.emulated_seconds()}
        mesh.comm.emulate(None)
    return out


def _dims(size: int, plan: DitBenchPlan) -> Dims:
    return Dims(
        steps=plan.steps,
        layers=BENCH_MODEL.depth,
        tokens=(size // BENCH_MODEL.patch_size) ** 2,
        hidden=BENCH_MODEL.hidden_size,
        batch=plan.batch,
        latent_elems=BENCH_MODEL.in_channels * size * size,
        guidance=True,
    )


def _measure(
    name: str, size: int, plan: DitBenchPlan, links: dict[str, Link]
) -> tuple[dict, list, torch.Tensor]:
    """One layout at one size: its row (without the ratios to serial), its link rows and
    final latent."""
    config = LAYOUTS[name]
    ranks = spawn(_rank_run, config.world_size, config, size, plan, links, timeout_s=3600)
    dims = _dims(size, plan)
    measured, formula = measured_bytes([r["ledger"] for r in ranks]), formula_bytes(config, dims)
    # The slowest rank ends each run; the fastest run is the least disturbed.
    per_run = [max(r["all_seconds"][i] for r in ranks) for i in range(plan.repeats)]
    row = {
        "method": name,
        "layout": LABELS[name],
        "size": f"{size}x{size}",
        "tokens": dims.tokens,
        "ranks": config.world_size,
        "seconds": round(min(per_run), 3),
        "all_seconds": [round(s, 3) for s in per_run],
        "spread": round((max(per_run) - min(per_run)) / min(per_run), 3),
        "bytes_per_step": measured // plan.steps,
        "formula_bytes_per_step": formula // plan.steps,
        "bytes_rel_error": abs(measured - formula) / formula if formula else float(measured != 0),
        "param_mib_per_rank": round(max(r["param_bytes"] for r in ranks) / 2**20, 2),
        "setup_rss_mib_per_rank": round(max(r["setup_rss"] for r in ranks) / 2**20, 1),
        "peak_rss_mib_per_rank": round(max(r["peak_rss"] for r in ranks) / 2**20, 1),
        "sampling_extra_mib_per_rank": round(max(r["sampling_extra"] for r in ranks) / 2**20, 1),
    }
    link_rows = [
        {
            "method": name,
            "link": link,
            "size": f"{size}x{size}",
            "steps": plan.link_steps,
            "seconds": round(max(r["links"][link]["seconds"] for r in ranks), 3),
            "emulated_wait_s": round(max(r["links"][link]["emulated_s"] for r in ranks), 3),
        }
        for link in links
    ]
    return row, link_rows, ranks[0]["latent"]


COLUMNS = [
    "method",
    "size",
    "tokens",
    "seconds",
    "spread",
    "speedup",
    "bytes_per_step",
    "formula_bytes_per_step",
    "bytes_rel_error",
    "param_mib_per_rank",
    "setup_rss_mib_per_rank",
    "sampling_extra_mib_per_rank",
    "rel_diff_vs_serial",
]
LINK_COLUMNS = ["method", "link", "size", "steps", "seconds", "emulated_wait_s", "compute_s", "speedup"]
FIDELITY_COLUMNS = [
    "method",
    "psnr_db",
    "mean_sample_psnr_db",
    "class_accuracy",
    "final_rel_error_vs_serial",
    "rel_diff_vs_reference",
]


def scaled_links(plan: DitBenchPlan) -> tuple[dict[str, Link], dict]:
    """The plan's links scaled to this core's compute against ``plan.link_device``'s."""
    if not plan.links:
        return {}, {}
    device = device_named(plan.link_device)
    core = matmul_peak_flops(threads=1)
    factor = core / device.fp32_flops
    links = {name: link_named(name).scaled(factor) for name in plan.links}
    info = {
        "core_fp32_flops": core,
        "device": device.name,
        "device_fp32_flops": device.fp32_flops,
        "device_source": device.source,
        "scale": factor,
        "links": {name: link.describe() for name, link in links.items()},
    }
    return links, info


def run_dit_bench(plan: DitBenchPlan, digits_model: Path | None, progress: bool = True) -> BenchResult:
    links, link_info = scaled_links(plan)
    rows, link_rows, serial = [], [], {}
    jobs = [(size, name) for size in plan.sizes for name in LAYOUTS]  # serial first at each size
    for size, name in tqdm(jobs, desc="bench dit", disable=not progress):
        row, link_part, latent = _measure(name, size, plan, links if size == plan.sizes[-1] else {})
        if name == "serial":
            serial[size] = (row["seconds"], latent)
        base_seconds, base_latent = serial[size]
        row["speedup"] = round(base_seconds / row["seconds"], 3)
        row["rel_diff_vs_serial"] = float((latent - base_latent).norm() / base_latent.norm())
        rows.append(row)
        link_rows += link_part
    _link_ratios(link_rows)
    headline = _headline(rows, link_rows, plan)
    extra = {
        "plan": {k: getattr(plan, k) for k in plan.__dataclass_fields__},
        "model": BENCH_MODEL.to_dict(),
        "layouts": LABELS,
        "link_scaling": link_info,
        "link_rows": link_rows,
    }
    tables = (
        [(f"Emulated links at {plan.sizes[-1]}x{plan.sizes[-1]}", LINK_COLUMNS, link_rows)] if links else []
    )
    notes = _notes(plan, link_info)
    if digits_model is not None:
        from tessera.bench.dit_fidelity import run_fidelity

        extra["fidelity"] = run_fidelity(digits_model, per_digit=plan.fidelity_per_digit)
        headline |= {f"psnr_{row['method']}": row["psnr_db"] for row in extra["fidelity"][1:]}
        tables.append(
            ("Fidelity on the trained digits DiT (2 ranks, 20 steps)", FIDELITY_COLUMNS, extra["fidelity"])
        )
    else:
        notes.append("fidelity skipped: no trained digits checkpoint (run `make demo` first)")
    return BenchResult(
        name="dit", headline=headline, rows=rows, columns=COLUMNS, notes=notes, extra=extra, tables=tables
    )


def _link_ratios(link_rows: list[dict]) -> None:
    serial = {r["link"]: r["seconds"] for r in link_rows if r["method"] == "serial"}
    for r in link_rows:
        r["compute_s"] = round(r["seconds"] - r["emulated_wait_s"], 3)
        r["speedup"] = round(serial[r["link"]] / r["seconds"], 3)


def _headline(rows: list[dict], link_rows: list[dict], plan: DitBenchPlan) -> dict:
    largest = f"{plan.sizes[-1]}x{plan.sizes[-1]}"
    at_largest = {r["method"]: r for r in rows if r["size"] == largest}
    headline = {
        "largest_size": largest,
        "largest_tokens": at_largest["serial"]["tokens"],
        "pipefusion_speedup": at_largest["pipefusion"]["speedup"],
        "max_bytes_rel_error": max(r["bytes_rel_error"] for r in rows),
        "pipefusion_bytes_vs_ulysses": round(
            at_largest["pipefusion"]["bytes_per_step"] / at_largest["ulysses"]["bytes_per_step"], 4
        ),
    }
    for link in plan.links:
        mine = {r["method"]: r["speedup"] for r in link_rows if r["link"] == link and r["method"] != "serial"}
        best_other = max((m for m in mine if m != "pipefusion"), key=mine.get)
        headline[f"{link}_pipefusion_speedup"] = mine["pipefusion"]
        headline[f"{link}_best_other"] = f"{best_other} {mine[best_other]}"
    return headline


def _notes(plan: DitBenchPlan, link_info: dict) -> list[str]:
    notes = [
        "serial: 1 process x 1 thread; every method: 2 gloo ranks x 1 thread (one core = one device)",
        f"seconds: the fastest of {plan.repeats} timed run(s) after an untimed 1-step run (all_seconds in the JSON); "
        "spread: (slowest - fastest) / fastest",
        "tokens: image tokens of the latent ((size / 2)^2 with 2x2 patches)",
        "bytes: summed over ranks, receives not added; formulas in src/tessera/diffusion/comm_bytes.py",
        "param_mib_per_rank: parameter bytes the rank holds after set-up, counted from its tensors (PipeFusion "
        "frees other stages' blocks, TP holds its shards); setup_rss: resident memory added by building the "
        "model and setting it up",
        "rel_diff_vs_serial: ||x - x_serial|| / ||x_serial|| of the final latent (random weights: stale "
        "K/V methods are far from their trained-model fidelity here; see the fidelity table)",
    ]
    if link_info:
        notes.append(
            f"emulated links: {', '.join(link_info['links'].values())}; scale = this core's fp32 matmul rate "
            f"({link_info['core_fp32_flops'] / 1e9:.0f} GFLOP/s) / {link_info['device']}'s "
            f"({link_info['device_fp32_flops'] / 1e12:.1f} TFLOP/s, {link_info['device_source']}); "
            f"{plan.link_steps} steps per run; emulated_wait_s: the slowest rank's time spent waiting for "
            "the link beyond the loopback transfer; compute_s = seconds - emulated_wait_s"
        )
    return notes


def plot_dit(result: BenchResult, path: Path) -> None:
    from tessera.bench.dit_plot import plot_dit as draw

    draw(result, path, [name for name in LAYOUTS if name != "serial"])
