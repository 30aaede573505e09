"""`tessera bench dit-video`: the video DiT, the parallel VAE decode and the text encoder
held once (#31), each against its serial baseline in the same run.

* Video: a Wan-shaped ``WanTransformer3DModel`` (random weights; frame x row token rows)
  sampled serially (1 process x 1 thread) and by every method on 2 ranks x 1 thread (one
  core = one device, as in `bench dit`), on loopback and with transfers timed as on an
  emulated link scaled to this core's compute (``bench.dit.scaled_links``); bytes measured
  by ``runtime.comm`` beside ``diffusion.comm_bytes.formula_bytes``.
* Parallel VAE decode: ``AutoencoderKL`` and Wan's ``AutoencoderKLWan``, serial decode vs
  2 ranks (rows split) and vs chunked convolution on one device: seconds and the activation
  peak (live tensor bytes, ``TensorMemory``) per rank.
* Text encoder: parameter bytes and resident memory each rank holds after loading a saved
  pipeline, every rank loading the text encoder ("before") vs rank 0 alone, as ``tessera
  generate`` does, each way in fresh processes (``bench.dit_text_memory``).

The rows, columns and plot are ``bench.dit_video_report``.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.bench.dit_text_memory import (
    TEXT_COLUMNS,
    TEXT_NOTE,
    measure_text_encoder_memory,
    text_memory_rows,
    text_pipeline,
)
from tessera.bench.dit_video_report import (  # noqa: F401  (plot_dit_video: the command's plot)
    LINK_COLUMNS,
    VAE_COLUMNS,
    VIDEO_COLUMNS,
    _vae_rows,
    _video_rows,
    plot_dit_video,
)
from tessera.bench.harness import BenchResult
from tessera.diffusion.comm_bytes import Dims
from tessera.diffusion.layout import ParallelConfig
from tessera.runtime import spawn
from tessera.runtime.link import Link

GUIDANCE = 5.0
LAYOUTS: dict[str, ParallelConfig] = {
    "ulysses": ParallelConfig(ulysses=2),
    "ring": ParallelConfig(ring=2),
    "pipefusion": ParallelConfig(pipefusion=2, patches=4, warmup_steps=1),
    "distrifusion": ParallelConfig(distrifusion=2, warmup_steps=1),
    "cfg_parallel": ParallelConfig(cfg_parallel=True),
    "tensor_parallel": ParallelConfig(tp=2),
}


@dataclass(frozen=True, kw_only=True)
class VideoBenchPlan:
    frames: int  # latent frames
    latent: int  # latent height = width
    layers: int
    steps: int
    repeats: int
    vae_latent: int  # AutoencoderKL latent height = width
    wan_vae_latent: int
    links: tuple[str, ...] = ("pcie4",)
    link_steps: int = 2


FULL = VideoBenchPlan(frames=5, latent=16, layers=8, steps=8, repeats=3, vae_latent=48, wan_vae_latent=32)
QUICK = VideoBenchPlan(
    frames=3, latent=12, layers=4, steps=3, repeats=3, vae_latent=24, wan_vae_latent=16, link_steps=2
)
HIDDEN, HEADS, CHANNELS, TEXT, TEXT_TOKENS = 256, 4, 16, 64, 32


def video_model(layers: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HIDDEN // HEADS,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        text_dim=TEXT,
        freq_dim=64,
        ffn_dim=4 * HIDDEN,
        num_layers=layers,
        rope_max_seq_len=64,
    ).eval()


def _inputs(plan: VideoBenchPlan) -> dict:
    g = torch.Generator().manual_seed(1)
    frames = torch.tensor([plan.frames])
    noise = torch.randn(1, CHANNELS, plan.frames * plan.latent, plan.latent, generator=g)
    return {
        "cond": {"prompt_embeds": torch.randn(1, TEXT_TOKENS, TEXT, generator=g), "latent_frames": frames},
        "uncond": {"prompt_embeds": torch.randn(1, TEXT_TOKENS, TEXT, generator=g), "latent_frames": frames},
        "noise": noise,
    }


def _sample(
    model, plan: VideoBenchPlan, config: ParallelConfig, mesh, steps: int
) -> tuple[float, torch.Tensor]:
    from diffusers import UniPCMultistepScheduler

    from tessera.diffusion.parallel import parallel_denoise
    from tessera.diffusion.stepper import DiffusersStepper

    data = _inputs(plan)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    mesh.comm.ledger.reset()
    mesh.comm.barrier()
    began = time.perf_counter()
    latent = parallel_denoise(
        model,
        cond=data["cond"],
        uncond=data["uncond"],
        guidance_scale=GUIDANCE,
        stepper=DiffusersStepper(scheduler, steps),
        noise=data["noise"],
        config=config,
        mesh=mesh,
    )
    return time.perf_counter() - began, latent


def _video_runs(plan: VideoBenchPlan, configs: dict[str, ParallelConfig], links: dict[str, Link]) -> dict:
    """Every layout in ``configs`` in this process group: seconds of each timed run, the
    ledger, the final latent, and the emulated-link runs."""
    from tessera.diffusion.pipefusion import release_other_stages

    out = {}
    for name, config in configs.items():
        model, mesh = video_model(plan.layers), config.build_mesh()
        if config.method == "pipefusion":
            release_other_stages(model, config, mesh)
        elif config.method == "tp":  # split once, as a user's run does, not inside every timed run
            from tessera.diffusion.tensor_parallel import inference_plan
            from tessera.parallel.tp_plans import apply_tp

            apply_tp(model, inference_plan(model), mesh.device_mesh["tp"], config.tp, src_data_rank=None)
        _sample(model, plan, config, mesh, 1)  # start-up costs out of the figure
        times = []
        for _ in range(plan.repeats):
            seconds, latent = _sample(model, plan, config, mesh, plan.steps)
            times.append(seconds)
        row = {"all_seconds": times, "ledger": mesh.comm.ledger.snapshot(), "latent": latent, "links": {}}
        for link_name, link in links.items():
            mesh.comm.emulate(link)
            seconds, _ = _sample(model, plan, config, mesh, plan.link_steps)
            row["links"][link_name] = {"seconds": seconds, "emulated_s": mesh.comm.ledger.emulated_seconds()}
            mesh.comm.emulate(None)
        out[name] = row
    return out


def _vae_case(kind: str, plan: VideoBenchPlan):
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(0)
    if kind == "AutoencoderKL":
        from diffusers import AutoencoderKL

        vae = AutoencoderKL(
            latent_channels=4,
            block_out_channels=(64, 128, 128),
            down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3,
            layers_per_block=1,
            norm_num_groups=32,
        ).eval()
        return vae, torch.randn(1, 4, plan.vae_latent, plan.vae_latent, generator=g)
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(
        base_dim=32,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
        scale_factor_temporal=2,
        scale_factor_spatial=4,
    ).eval()
    return vae, torch.randn(1, 4, 3, plan.wan_vae_latent, plan.wan_vae_latent, generator=g)


def _vae_runs(plan: VideoBenchPlan, mesh, repeats: int, cases) -> dict:
    """(fastest seconds, activation peak) of each (VAE class, chunk rows) decode on this rank."""
    from tessera.diffusion.vae_parallel import VaeSplit, decode_rows
    from tessera.memory.track import TensorMemory

    out = {}
    for kind, chunk in cases:
        vae, z = _vae_case(kind, plan)
        split = VaeSplit(mesh=mesh, chunk_rows=chunk)
        with TensorMemory() as mem:
            decode_rows(vae, z, split)
        times = []
        for _ in range(repeats):
            if mesh is not None:
                mesh.comm.barrier()
            began = time.perf_counter()
            decode_rows(vae, z, split)
            times.append(time.perf_counter() - began)
        out[(kind, chunk)] = {"seconds": min(times), "all_seconds": times, "peak": mem.peak}
    return out


@torch.no_grad()
def _serial_vae(plan: VideoBenchPlan) -> dict:
    from tessera.memory.track import TensorMemory

    out = {}
    for kind in ("AutoencoderKL", "AutoencoderKLWan"):
        vae, z = _vae_case(kind, plan)
        with TensorMemory() as mem:
            vae.decode(z)
        times = []
        for _ in range(plan.repeats):
            began = time.perf_counter()
            vae.decode(z)
            times.append(time.perf_counter() - began)
        out[kind] = {"seconds": min(times), "all_seconds": times, "peak": mem.peak}
    return out


PARALLEL_VAE_CASES = [("AutoencoderKL", None), ("AutoencoderKL", 8), ("AutoencoderKLWan", None)]


@torch.no_grad()
def _rank(plan: VideoBenchPlan, links: dict[str, Link]) -> dict:
    from tessera.runtime.mesh import Mesh

    return {
        "video": _video_runs(plan, LAYOUTS, links),
        "vae": _vae_runs(plan, Mesh(vae=2), plan.repeats, PARALLEL_VAE_CASES),
    }


def _video_dims(plan: VideoBenchPlan, steps: int) -> Dims:
    tokens = plan.frames * (plan.latent // 2) ** 2
    return Dims(
        steps=steps,
        layers=plan.layers,
        tokens=tokens,
        hidden=HIDDEN,
        batch=1,
        latent_elems=CHANNELS * plan.frames * plan.latent * plan.latent,
        guidance=True,
        tp_all_reduces=3,  # Wan's self- and cross-attention and MLP outputs
        tp_norm_rows=3 * tokens + TEXT_TOKENS,  # its q/k norms across heads (comm_bytes.Dims)
    )


def run_dit_video_bench(quick: bool = False) -> BenchResult:
    from tessera.bench.dit import DitBenchPlan, scaled_links

    plan = QUICK if quick else FULL
    links, link_info = scaled_links(DitBenchPlan(sizes=(plan.latent,), steps=plan.steps, links=plan.links))
    with torch.no_grad():
        serial = _video_runs(plan, {"serial": ParallelConfig()}, links)["serial"]
    serial_vae = _serial_vae(plan)
    serial_vae_chunked = _vae_runs_serial_chunked(plan)
    ranks = spawn(_rank, 2, plan, links, timeout_s=3600)
    with tempfile.TemporaryDirectory() as tmp:
        text_rows = text_memory_rows(measure_text_encoder_memory(text_pipeline(Path(tmp) / "pixart")))
    video_rows, link_rows = _video_rows(plan, serial, ranks, links, LAYOUTS, _video_dims(plan, plan.steps))
    vae_rows = _vae_rows(serial_vae, serial_vae_chunked, ranks)
    headline = {
        "video_tokens": _video_dims(plan, plan.steps).tokens,
        **{f"video_{r['method']}_speedup": r["speedup"] for r in video_rows if r["method"] != "serial"},
        "video_max_bytes_rel_error": max(r["bytes_rel_error"] for r in video_rows),
        **{
            f"video_{link}_{r['method']}_speedup": r["speedup"]
            for link in links
            for r in link_rows
            if r["link"] == link and r["method"] != "serial"
        },
        "vae_kl_peak_per_rank_vs_serial": next(
            r["peak_vs_serial"] for r in vae_rows if r["vae"] == "AutoencoderKL" and r["decode"] == "2 ranks"
        ),
        "vae_wan_peak_per_rank_vs_serial": next(
            r["peak_vs_serial"]
            for r in vae_rows
            if r["vae"] == "AutoencoderKLWan" and r["decode"] == "2 ranks"
        ),
        "text_encoder_rank1_mib_before_after": [
            text_rows[1]["params_mib_before"],
            text_rows[1]["params_mib_after"],
        ],
        "text_encoder_rank1_rss_mib_before_after": [
            text_rows[1]["rss_mib_before"],
            text_rows[1]["rss_mib_after"],
        ],
    }
    notes = [
        f"video: WanTransformer3DModel, {plan.layers} layers, hidden {HIDDEN}, {HEADS} heads; latent "
        f"{plan.frames} frames x {plan.latent}x{plan.latent} ({headline['video_tokens']} tokens), "
        f"{plan.steps} UniPC steps, guidance {GUIDANCE}; serial: 1 process x 1 thread, methods: 2 gloo ranks x 1 "
        "thread; seconds: the fastest of the timed runs after an untimed 1-step run; spread: (slowest - fastest) "
        "/ fastest",
        "bytes: summed over ranks, receives not added; formula: src/tessera/diffusion/comm_bytes.py",
        "vae: decode seconds (fastest of the repeats) and activation peak (live tensor bytes the decode adds, "
        "TensorMemory) per rank; 2 ranks: rows split (halo exchange, norms reduced over ranks); chunked: "
        "convolutions over 8 output rows at a time on one device",
        TEXT_NOTE,
    ]
    if link_info:
        notes.append(
            f"emulated links: {', '.join(link_info['links'].values())}; scaled by this core's fp32 matmul rate "
            f"over {link_info['device']}'s ({link_info['scale']:.2e}); {plan.link_steps} steps per run"
        )
    return BenchResult(
        name="dit-video",
        headline=headline,
        rows=video_rows,
        columns=VIDEO_COLUMNS,
        notes=notes,
        extra={
            "plan": plan.__dict__,
            "link_scaling": link_info,
            "link_rows": link_rows,
            "vae_rows": vae_rows,
            "text_rows": text_rows,
        },
        tables=[
            (f"Emulated links (video, {plan.link_steps} steps)", LINK_COLUMNS, link_rows),
            ("Parallel VAE decode", VAE_COLUMNS, vae_rows),
            ("Text encoder held once: parameter and resident MiB per rank", TEXT_COLUMNS, text_rows),
        ],
    )


@torch.no_grad()
def _vae_runs_serial_chunked(plan: VideoBenchPlan) -> dict:
    return _vae_runs(plan, None, plan.repeats, [("AutoencoderKL", 8)])
