"""One prepared run for a lent GPU: every Tessera path on CUDA over NCCL, checked against
its single-device reference (DiT methods, ZeRO stages with and without overlap, ZeRO-3
offloaded to the device, host and disk tiers, a tiny Mixtral's experts, DAP, AutoChunk,
diffusers pipelines, a tiny Wan 2.1 video pipeline incl. tensor parallel), plus PixArt-size
timings and ZeRO-3 offload's speed and device memory on GPT-2 small's blocks.

At world size 1 the process group is NCCL with one rank: `runtime.comm` checks every
tensor handed to a collective against the mesh's device even along axes of size 1, so a
CPU tensor that would crash NCCL on many GPUs fails here by name. With 2+ GPUs the same
paths run on 2 ranks (NCCL refuses two ranks on one GPU).

Run from the repository root:  PYTHONPATH=src python3 benchmarks/gpu/cuda_check.py OUT_DIR
Writes OUT_DIR/cuda_check.json and prints it. Runs on CPU too (gloo; a smoke test). Each
check records its result or its error and the run goes on. TESSERA_CHECK_BATCH=B,S sets the
offload timing's batch (default 8,512); TESSERA_CHECK_DETERMINISTIC=1 (with
CUBLAS_WORKSPACE_CONFIG=:4096:8) turns on torch's deterministic algorithms, so runs that differ
only in placement (offload or not) can be compared bit for bit.
"""

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "diffusion"), str(ROOT / "tests" / "train")]  # tiny models

from tessera.diffusion.layout import ParallelConfig  # noqa: E402
from tessera.diffusion.parallel import parallel_sample  # noqa: E402
from tessera.diffusion.sampler import sample  # noqa: E402
from tessera.models.dit import DiT, DiTConfig  # noqa: E402
from tessera.runtime import spawn  # noqa: E402
from tessera.train.losses import causal_lm_loss as loss_fn  # noqa: E402  (mean next-token cross-entropy)

CUDA = torch.cuda.is_available()
if os.environ.get("TESSERA_CHECK_DETERMINISTIC"):  # CUDA's atomics-based kernels off (needs CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True)
BACKEND = "nccl" if CUDA else "gloo"
SMALL = DiTConfig(
    image_size=32, in_channels=4, patch_size=2, hidden_size=256, depth=6, num_heads=8, num_classes=10
)
# PixArt-alpha's transformer shape: 28 layers, hidden 1152, 16 heads, 2x2 patches, 4 latent channels.
PIXART = DiTConfig(
    image_size=128, in_channels=4, patch_size=2, hidden_size=1152, depth=28, num_heads=16, num_classes=10
)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def guarded(fn, *args) -> object:
    try:
        return fn(*args)
    except Exception:
        return "failed: " + traceback.format_exc()[-1200:]


def build_dit(config: DiTConfig, dtype=torch.float32) -> DiT:
    torch.manual_seed(0)
    model = DiT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.to(device=device(), dtype=dtype).eval()


# ---- the checks, each run on every rank of the group ------------------------------------


def dit_methods(layouts: dict[str, ParallelConfig]) -> dict:
    model, labels = build_dit(SMALL), torch.tensor([1, 7])
    kw = dict(height=32, width=32, num_steps=4, guidance_scale=3.0, seed=0)
    serial = sample(
        model, labels, image_shape=(4, 32, 32), num_steps=4, guidance_scale=3.0, seed=0, progress=False
    )
    return {
        name: guarded(lambda c=c: rel(parallel_sample(model, labels, config=c, **kw), serial))
        for name, c in layouts.items()
    }


def boost_paths(plans: dict) -> dict:
    """Each plan (``name: (model, Plan's settings)``) trains 2 AdamW steps through ``tessera.boost`` and
    is compared with plain torch on this device: the tiny GPT-2, or the tiny Mixtral (8
    experts, top-2) for the expert paths; ZeRO-3 with offload puts chunks on the device tier
    (CUDA), the host tier (pinned) and a disk tier."""
    from tiny_lm import tiny_gpt2
    from tiny_moe import tiny_moe

    import tessera
    from tessera.train.export import full_state_dict

    builders = {"gpt2": tiny_gpt2, "mixtral": lambda: tiny_moe("mixtral")}
    out = {}
    # on the CPU, as the recipes build their batches: train_step moves each rank's share to the
    # mesh's device (a CPU batch handed to a CUDA model would crash)
    tokens = torch.randint(0, 128, (8, 12), generator=torch.Generator().manual_seed(0))

    def reference(family: str, precision: str) -> dict:  # plain torch on this device, autocast as the plan says
        model = builders[family]().to(device())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast(device().type, torch.bfloat16, enabled=precision == "bf16"):
                loss = loss_fn(model, tokens.to(device()))
            loss.backward()
            opt.step()
        return model.state_dict()

    wanted = {(family, settings.get("precision", "fp32")) for family, settings in plans.values()}
    references = {key: reference(*key) for key in wanted}
    for name, (family, settings) in plans.items():

        def run(family=family, settings=settings):
            plan = tessera.Plan(**settings)  # a refused plan is this check's error, not the group's
            model = builders[family]()
            model, optimizer = tessera.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan)
            for _ in range(2):
                stats = optimizer.train_step(tokens, loss_fn)
            full = full_state_dict(model, optimizer)  # whole, in the model class's layout
            want = references[family, plan.precision]
            return {
                "loss": float(stats["loss"]),
                "max_rel_param": max(rel(full[n].to(want[n].device), want[n]) for n in full if n in want),
            }

        out[name] = guarded(run)
    return out


def dap_path(world: int) -> object:
    from tessera.fold.dap import dap_evoformer
    from tessera.models.evoformer import Evoformer, EvoformerConfig
    from tessera.runtime import Mesh

    cfg = EvoformerConfig(
        c_m=16,
        c_z=8,
        msa_heads=2,
        msa_head_dim=4,
        pair_heads=2,
        pair_head_dim=4,
        c_mul=8,
        c_opm=4,
        num_blocks=2,
    )
    torch.manual_seed(0)
    model = Evoformer(cfg).to(device()).eval()
    m, z = torch.randn(1, 4, 8, 16, device=device()), torch.randn(1, 8, 8, 8, device=device())
    with torch.no_grad():
        want = model(m, z)
        got = dap_evoformer(model, m, z, mesh=Mesh(dap=world))  # default masks: on the inputs' device
    return {"m": rel(got[0], want[0]), "z": rel(got[1], want[1])}


def autochunk_path() -> object:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import tessera

    block = GPT2Block(GPT2Config(n_embd=64, n_head=4, attn_implementation="eager")).to(device()).eval()
    x = torch.randn(1, 256, 64, device=device())
    chunked = tessera.autochunk(block, (x,))
    with torch.no_grad():
        return rel(chunked(x)[0], block(x)[0])


def pipelines_path(config: ParallelConfig) -> dict:
    import os
    import shutil
    import tempfile

    from tiny_pipelines import build_flux_pipeline, build_pixart_pipeline, build_sd3_pipeline

    from tessera.diffusion.pipelines import generate, load_pipeline
    from tessera.runtime.mesh import global_rank

    out = {}
    for name, build in {
        "pixart": build_pixart_pipeline,
        "sd3": build_sd3_pipeline,
        "flux": build_flux_pipeline,
    }.items():

        def run(build=build, name=name):
            # One folder for the group (the ranks share their parent): rank 0 saves, all load.
            folder = Path(tempfile.gettempdir()) / f"tessera-cuda-check-{name}-{os.getppid()}"
            if global_rank() == 0:
                shutil.rmtree(folder, ignore_errors=True)
                build(folder)
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            pipe = load_pipeline(folder).to(device())
            extra = {"clean_caption": False, "use_resolution_binning": False} if name == "pixart" else {}
            own = pipe(  # the pipeline's own __call__, same seed
                "a red cat",
                num_inference_steps=2,
                guidance_scale=4.5,
                height=32,
                width=32,
                generator=torch.Generator().manual_seed(0),
                output_type="pt",
                **extra,
            ).images[0]
            kw = dict(prompt="a red cat", height=32, width=32, num_steps=2, guidance_scale=4.5, seed=0)
            image = generate(pipe, config=config, output_type="pt", **kw)
            return None if image is None else rel(image, own)

        out[name] = guarded(run)
    return out


def video_path(configs: dict[str, ParallelConfig]) -> dict:
    """A tiny saved Wan 2.1 pipeline: WanPipeline's own frames vs tessera's generate under
    each layout (the text encoder on rank 0, the VAE decode as the pipeline does it)."""
    import os
    import shutil
    import tempfile

    from tiny_wan import build_wan_pipeline

    from tessera.diffusion.pipelines import generate, load_pipeline
    from tessera.runtime.mesh import global_rank

    folder = Path(tempfile.gettempdir()) / f"tessera-cuda-check-wan-{os.getppid()}"
    if global_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
        build_wan_pipeline(folder)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    pipe = load_pipeline(folder).to(device())
    pipe.set_progress_bar_config(disable=True)
    video = dict(prompt="a red cat", guidance_scale=5.0, height=32, width=16, num_frames=5)

    def own():
        return pipe(
            **video, num_inference_steps=2, generator=torch.Generator().manual_seed(3), output_type="pt"
        ).frames[0]

    def run(config, reference):
        frames = generate(pipe, **video, num_steps=2, seed=3, config=config, output_type="pt")
        return None if frames is None else rel(frames, reference)

    out = {name: guarded(run, config, own()) for name, config in configs.items()}
    if CUDA:  # cuDNN's convolutions default to TF32 (10-bit mantissa): the same runs in full fp32
        torch.backends.cudnn.allow_tf32 = False
        try:
            reference = own()
            out |= {f"{name}_cudnn_fp32": guarded(run, config, reference) for name, config in configs.items()}
        finally:
            torch.backends.cudnn.allow_tf32 = True
    return out


def group_checks(world: int) -> dict:

    if world == 1:
        dit = {
            "serial": ParallelConfig(),
            "patches4_warmup_all": ParallelConfig(num_patches=4, warmup_steps=4),
            "patches4_warmup1 (stale: not 0)": ParallelConfig(num_patches=4, warmup_steps=1),
        }
        # offload: 16 KiB chunks; on CUDA the device tier holds ~7 of them, the rest go to pinned
        # host memory (and, with a host budget, on to disk); on the CPU the host tier is the
        # first, and a bounded one needs the disk tier behind it
        folder = f"/tmp/tessera-cuda-check-offload-{os.getpid()}"
        tier = dict(device_memory=120_000) if CUDA else dict(host_memory=120_000, offload_dir=folder)
        offload = dict(zero=3, chunk_mib=0.016, offload="auto", **tier)
        plans = {f"zero{z}": ("gpt2", dict(zero=z)) for z in range(4)} | {
            "zero3_bf16": ("gpt2", dict(zero=3, precision="bf16")),
            "zero3_prefetch0": ("gpt2", dict(zero=3, prefetch=0)),
            "zero3_offload_auto": ("gpt2", offload),
            "zero3_offload_static": ("gpt2", offload | dict(offload="static")),
            "zero3_offload_disk": (
                "gpt2",
                offload | dict(host_memory=120_000, offload_dir=folder),
            ),
            "moe_zero0": ("mixtral", dict()),
            "moe_zero3": ("mixtral", dict(zero=3)),
            "moe_zero3_bf16": ("mixtral", dict(zero=3, precision="bf16")),
        }
        pipeline_layout = ParallelConfig(num_patches=2, warmup_steps=2)
        video = {"serial": ParallelConfig()}
    else:
        dit = {
            "pipefusion2_warmup_all": ParallelConfig(pipefusion_degree=2, num_patches=4, warmup_steps=4),
            "ulysses2": ParallelConfig(ulysses_degree=2),
            "ring2": ParallelConfig(ring_degree=2),
            "distrifusion2_warmup_all": ParallelConfig(distrifusion_degree=2, warmup_steps=4),
            "tp2": ParallelConfig(tp_degree=2),
            "cfg2": ParallelConfig(cfg_parallel=True),
        }
        plans = {f"dp2_zero{z}": ("gpt2", dict(dp=2, zero=z)) for z in range(4)} | {
            "tp2": ("gpt2", dict(tp=2)),
            "dp2_zero3_prefetch0": ("gpt2", dict(dp=2, zero=3, prefetch=0)),
            "dp2_zero3_prefetch2": ("gpt2", dict(dp=2, zero=3, prefetch=2)),
            "ep2_zero1": ("mixtral", dict(dp=2, ep=2, zero=1)),
            "ep2_zero3": ("mixtral", dict(dp=2, ep=2, zero=3)),
        }
        pipeline_layout = ParallelConfig(pipefusion_degree=2, num_patches=2, warmup_steps=2)
        video = {
            "ulysses2": ParallelConfig(ulysses=2),
            "tp2": ParallelConfig(tp=2),
            "cfg2": ParallelConfig(cfg_parallel=True),
        }
    return {
        "dit_methods_rel_vs_serial": guarded(dit_methods, dit),
        "boost_vs_torch": guarded(boost_paths, plans),
        "dap_rel": guarded(dap_path, world),
        "autochunk_rel": guarded(autochunk_path),
        "pipelines_rel_vs_serial": guarded(pipelines_path, pipeline_layout),
        "wan_video_rel_vs_pipeline": guarded(video_path, video),
    }


def pixart_timings() -> list[dict]:
    rows, dtype = [], torch.bfloat16 if CUDA else torch.float32
    model = build_dit(PIXART if CUDA else SMALL, dtype=dtype)
    for size in (64, 128) if CUDA else (16,):
        for name, config in {
            "serial": ParallelConfig(),
            "patches4": ParallelConfig(num_patches=4, warmup_steps=1),
        }.items():

            def run(config=config, size=size):
                parallel_sample(
                    model,
                    torch.tensor([3]),
                    config=config,
                    height=size,
                    width=size,
                    num_steps=8,
                    guidance_scale=4.0,
                    seed=0,
                )
                if CUDA:
                    torch.cuda.synchronize()

            run()
            began = time.perf_counter()
            run()
            rows.append(
                {
                    "layout": name,
                    "latent": f"{size}x{size}",
                    "dtype": str(dtype),
                    "seconds_8_steps": round(time.perf_counter() - began, 4),
                }
            )
    return rows


BATCH = tuple(int(v) for v in os.environ.get("TESSERA_CHECK_BATCH", "8,512").split(","))


def offload_plans() -> dict[str, dict]:
    """ZeRO-3 in device memory, and offloaded with the device tier's budget at a fraction of
    the model data (fp32 parameters, gradients and Adam's two moments: 16 bytes a parameter),
    the rest in pinned host memory (on the CPU: a host budget with a disk tier behind)."""
    chunk = dict(chunk_mib=32.0 if CUDA else 0.25)
    if CUDA:
        tier = {f"offload_device_{f}": dict(device_memory=f) for f in (0.5, 0.25)}
    else:
        tier = {"offload_host_0.5": dict(host_memory=0.5, offload_dir="/tmp/tessera-cuda-check-offload-timing")}
    return {"zero3": dict(zero=3, **chunk)} | {
        name: dict(zero=3, offload="auto", **chunk, **budget) for name, budget in tier.items()
    }


def offload_timing(name: str) -> dict:
    """One of ``offload_plans`` in a process of its own (so no plan sees another's memory):
    GPT-2 small's blocks (92M parameters with an 8192-token vocabulary; a tiny GPT-2 on the
    CPU) trained with AdamW; tokens/s over 4 timed steps after 3 warm-up steps (the first of
    offload's is its trace), the peak device memory of the timed steps and what stays
    allocated after them, each less what the process held before the model was built."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import tessera

    # GPT-2 small's blocks with an 8192-token vocabulary: every parameter fits a 32 MiB chunk
    small = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=8192) if CUDA else dict(
        n_layer=2, n_embd=64, n_head=4, vocab_size=512
    )
    batch, seq = BATCH if CUDA else (2, 32)
    tokens = torch.randint(0, small["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))

    base = torch.cuda.memory_allocated() if CUDA else 0
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **small))
    model_bytes = 16 * sum(p.numel() for p in model.parameters())
    settings = dict(offload_plans()[name])
    for key in ("device_memory", "host_memory"):  # given as fractions of the model data
        if key in settings:
            settings[key] = int(settings[key] * model_bytes)
    if "offload_dir" in settings:
        settings["offload_dir"] += f"-{os.getpid()}"
    model, optimizer = tessera.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4), tessera.Plan(**settings))
    for _ in range(3):
        optimizer.train_step(tokens, loss_fn)
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for _ in range(4):
        stats = optimizer.train_step(tokens, loss_fn)
    if CUDA:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    mib = 2**20
    return {
        "tokens_per_s": round(4 * batch * seq / seconds, 1),
        "peak_device_mib": round((torch.cuda.max_memory_allocated() - base) / mib, 1) if CUDA else None,
        "allocated_after_mib": round((torch.cuda.memory_allocated() - base) / mib, 1) if CUDA else None,
        "device_budget_mib": round(settings["device_memory"] / mib, 1) if "device_memory" in settings else None,
        "model_data_mib": round(model_bytes / mib, 1),
        "loss": float(stats["loss"]),
    }


def offload_timings() -> dict:
    def one(name):
        return spawn(offload_timing, 1, name, backend=BACKEND, timeout_s=300, collective_timeout_s=60)[0]

    return {name: guarded(one, name) for name in offload_plans()}


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    gpus = torch.cuda.device_count()
    report = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if CUDA else "cpu",
        "gpus": gpus,
        "backend": BACKEND,
    }
    stages = [
        (
            "world1",
            lambda: spawn(group_checks, 1, 1, backend=BACKEND, timeout_s=400, collective_timeout_s=60)[0],
        )
    ]
    if gpus >= 2 or not CUDA:
        stages.append(
            (
                "world2",
                lambda: spawn(group_checks, 2, 2, backend=BACKEND, timeout_s=400, collective_timeout_s=60)[0],
            )
        )
    else:
        report["world2"] = f"skipped: {gpus} GPU (NCCL refuses two ranks on one GPU)"
    stages.append(("pixart_timings", pixart_timings))
    stages.append(("offload_timings", offload_timings))
    for name, fn in stages:
        began = time.perf_counter()
        report[name] = guarded(fn)
        print(f"{name} done in {time.perf_counter() - began:.1f}s", flush=True)
        (out_dir / "cuda_check.json").write_text(json.dumps(report, indent=2))  # partial results survive
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
