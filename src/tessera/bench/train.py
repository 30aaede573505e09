"""`tessera bench train`: one GPT-2-family model trained on 2 ranks (gloo, 1 thread each)
by torch DDP, torch FSDP2 (``fully_shard`` per block and root), DeepSpeed ZeRO-3 (if the
optional ``deepspeed`` extra is installed) and Tessera's plans dp / zero1 / zero2 / zero3 /
tp — in one run, same model, same data, same optimizer.

Per variant (each in its own freshly spawned processes): tokens/s over the timed steps
(after warm-up), achieved FLOP/s (6 x parameters x tokens/s, plus attention) and an MFU
estimate against this machine's measured fp32 matmul peak (one thread per rank), the peak
resident memory each rank added from just before the model was built (``VmHWM``, with
``MALLOC_MMAP_THRESHOLD_`` set so freed blocks return to the OS), and, for Tessera, the
bytes each mesh axis moved per step (``runtime.comm``'s ledger).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from tessera.bench.harness import BenchResult, matmul_peak_flops
from tessera.memory.track import reset_peak_rss, status_kib
from tessera.train.gpt2_text import flops_per_token, gpt2_lm
from tessera.train.losses import causal_lm_loss

MiB = 2**20
RANKS = 2


@dataclass(frozen=True)
class TrainBenchConfig:
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 8
    vocab: int = 4096
    seq: int = 128
    global_batch: int = 16
    warmup: int = 2
    steps: int = 6


FULL = TrainBenchConfig()
QUICK = TrainBenchConfig(n_embd=64, n_layer=2, n_head=4, vocab=512, seq=32, global_batch=8, warmup=1, steps=2)
VARIANTS = [
    "ddp",
    "fsdp2",
    "deepspeed_zero3",
    "tessera_dp",
    "tessera_zero1",
    "tessera_zero2",
    "tessera_zero3",
    "tessera_tp",
]


def _model(cfg: TrainBenchConfig) -> nn.Module:
    return gpt2_lm(vocab=cfg.vocab, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head, seq=cfg.seq)


def _batches(cfg: TrainBenchConfig) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, cfg.vocab, (cfg.global_batch, cfg.seq), generator=g)
        for _ in range(cfg.warmup + cfg.steps)
    ]


def _rank_run(variant: str, cfg: TrainBenchConfig) -> dict:
    import torch.distributed as dist

    from tessera.runtime import Mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches(cfg)
    local = cfg.global_batch // world
    before = reset_peak_rss()
    model = _model(cfg)
    ledger = None
    if variant.startswith("tessera"):
        import tessera

        kind = variant.removeprefix("tessera_")
        plan = {
            "dp": tessera.Plan(dp=world),
            "zero1": tessera.Plan(dp=world, zero=1),
            "zero2": tessera.Plan(dp=world, zero=2),
            "zero3": tessera.Plan(dp=world, zero=3),
            "tp": tessera.Plan(tp=world),
        }[kind]
        mesh = Mesh(dp=plan.dp, tp=plan.tp)
        model, opt = tessera.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan, mesh)
        ledger = mesh.comm.ledger

        def step(tokens):
            return opt.train_step(tokens, causal_lm_loss)["loss"]

    elif variant == "deepspeed_zero3":
        import deepspeed

        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config={
                "train_micro_batch_size_per_gpu": local,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3},
            },
        )

        def step(tokens):
            loss = causal_lm_loss(engine, tokens[rank * local : (rank + 1) * local])
            engine.backward(loss)
            engine.step()
            return loss.item()

    else:
        if variant == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)

        def step(tokens):
            opt.zero_grad()
            loss = causal_lm_loss(wrapped, tokens[rank * local : (rank + 1) * local])
            loss.backward()
            opt.step()
            return loss.item()

    for tokens in batches[: cfg.warmup]:
        step(tokens)
    if ledger is not None:
        ledger.reset()
    dist.barrier()
    began = time.perf_counter()
    losses = [step(tokens) for tokens in batches[cfg.warmup :]]
    dist.barrier()
    seconds = time.perf_counter() - began
    comm = ledger.snapshot() if ledger is not None else {}
    return {
        "seconds": seconds,
        "peak_mib": (status_kib("VmHWM") - before) / 1024,
        "loss": losses[-1],
        "comm_bytes_per_step": {k: v["bytes"] / cfg.steps for k, v in comm.items()},
    }


def run_train_bench(*, quick: bool, progress: bool = True, variants: list[str] | None = None) -> BenchResult:
    from tessera.runtime import spawn

    cfg = QUICK if quick else FULL
    try:
        import deepspeed  # noqa: F401

        have_deepspeed = True
    except ImportError:
        have_deepspeed = False
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # the ranks inherit it
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.abspath(".cache/torch_extensions"))
    params = sum(p.numel() for p in _model(cfg).parameters())
    peak = matmul_peak_flops() * RANKS
    tokens = cfg.global_batch * cfg.seq * cfg.steps
    rows = []
    unknown = set(variants or []) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown train bench variants {sorted(unknown)}; known: {VARIANTS}")
    for variant in tqdm(variants or VARIANTS, desc="train variants", disable=not progress):
        if variant == "deepspeed_zero3" and not have_deepspeed:
            continue
        results = spawn(_rank_run, RANKS, variant, cfg, timeout_s=1800)
        seconds = max(r["seconds"] for r in results)
        achieved = tokens / seconds * flops_per_token(params, cfg.n_layer, cfg.n_embd, cfg.seq)
        rows.append(
            {
                "variant": variant,
                "tokens_per_s": tokens / seconds,
                "peak_mib_per_rank": max(r["peak_mib"] for r in results),
                "achieved_gflops": achieved / 1e9,
                "mfu": achieved / peak,
                "final_loss": sum(r["loss"] for r in results) / len(results),  # mean over the ranks' shares
                "comm_mib_per_step": {
                    k: round(v / MiB, 3) for k, v in results[0]["comm_bytes_per_step"].items()
                },
            }
        )
    by = {r["variant"]: r for r in rows}
    headline = {}
    for base in ("fsdp2", "deepspeed_zero3"):
        if base in by and "tessera_zero3" in by:
            headline[f"zero3_tokens_per_s_vs_{base}"] = round(
                by["tessera_zero3"]["tokens_per_s"] / by[base]["tokens_per_s"], 3
            )
            headline[f"zero3_peak_mem_vs_{base}"] = round(
                by["tessera_zero3"]["peak_mib_per_rank"] / by[base]["peak_mib_per_rank"], 3
            )
    notes = [
        f"GPT-2 ({cfg.n_layer} layers, {cfg.n_embd} wide, {cfg.n_head} heads, vocab {cfg.vocab}, {params:,} parameters), "
        f"sequence {cfg.seq}, global batch {cfg.global_batch}, AdamW; {RANKS} gloo ranks x 1 thread; "
        f"{cfg.warmup} warm-up + {cfg.steps} timed steps.",
        f"MFU against a measured fp32 matmul peak of {peak / 1e9:.1f} GFLOP/s ({RANKS} ranks x 1 thread).",
        "peak_mib_per_rank: resident-memory high-water mark from just before the model was built "
        "(params, grads, optimizer states, activations, communication buffers, allocator).",
    ]
    if not have_deepspeed:
        notes.append(
            "DeepSpeed is not installed (optional extra: pip install '.[deepspeed]'): its row is absent."
        )
    return BenchResult(
        name="train",
        headline=headline,
        rows=rows,
        columns=[
            "variant",
            "tokens_per_s",
            "peak_mib_per_rank",
            "achieved_gflops",
            "mfu",
            "final_loss",
            "comm_mib_per_step",
        ],
        notes=notes,
        extra={"config": asdict(cfg), "parameters": params},
    )


def plot_train(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in result.rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["#1f77b4" if n.startswith("tessera") else "#7f7f7f" for n in names]
    ax_t.barh(names, [r["tokens_per_s"] for r in result.rows], color=colors)
    ax_t.set(title="training throughput", xlabel="tokens / s (2 ranks)")
    ax_m.barh(names, [r["peak_mib_per_rank"] for r in result.rows], color=colors)
    ax_m.set(title="peak memory per rank", xlabel="MiB")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
