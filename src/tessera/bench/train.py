"""`tessera bench train`: GPT-2 small (124M parameters) trained on 2 ranks (gloo, 1 thread
each) by torch DDP, torch FSDP2 (``fully_shard`` per block and root), DeepSpeed ZeRO-3 (if
the optional ``deepspeed`` extra is installed) and Tessera's ZeRO 0/1/2/3 — same model, data
and optimizer (torch AdamW) for all, every variant in the same run.

Like for like: Tessera's chunks are given the granularity FSDP2 is given (``block_chunks``:
a chunk per transformer block, the embeddings and final norm apart, as FSDP2's root holds
them); ZeRO-3 also runs with 32 MiB chunks that straddle blocks. DeepSpeed gets the ZeRO-3
settings its HuggingFace integration derives from the hidden size (``deepspeed_config``).

Per variant, three interleaved repeats (repeat 1 of every variant, then repeat 2, ...), each
in freshly spawned processes: tokens/s over ``steps`` timed steps after ``warmup`` (median
and range over the repeats); peak resident memory per rank as the high-water mark above a
baseline taken after every import (torch, transformers, DeepSpeed) and before the model is
built (``VmHWM``, with ``MALLOC_MMAP_THRESHOLD_`` set so freed blocks return to the OS); the
model-state bytes per rank — parameters, gradients, optimizer states — counted exactly from
the tensors each framework holds after a step (distinct storages, so views count once and
freed storage counts zero); achieved FLOP/s and MFU against this machine's fp32 matmul peak;
and, for Tessera, the bytes each collective moved per step.

Full run on 2 quiet cores: about 3 s a step (measured 7-14 s with other jobs on the cores);
7 variants x 3 repeats x (22 steps + ~20 s start-up), about 30 minutes. ``--quick``: a tiny
GPT-2, 1 repeat, about a minute.
"""

from __future__ import annotations

import gc
import os
import statistics
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
LR = 1e-4


@dataclass(frozen=True)
class TrainBenchConfig:
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    vocab: int = 50257
    seq: int = 128
    global_batch: int = 4
    warmup: int = 2
    steps: int = 20
    repeats: int = 3


FULL = TrainBenchConfig()
QUICK = TrainBenchConfig(
    n_embd=64, n_layer=2, n_head=4, vocab=512, seq=32, global_batch=4, warmup=1, steps=2, repeats=1
)
TESSERA = {  # variant -> Plan settings beside dp
    "tessera_dp": dict(zero=0, block_chunks=True),
    "tessera_zero1": dict(zero=1, block_chunks=True),
    "tessera_zero2": dict(zero=2, block_chunks=True),
    "tessera_zero3": dict(zero=3, block_chunks=True),
    "tessera_zero3_32mib": dict(zero=3, chunk_mib=32.0),
}
VARIANTS = ["ddp", "fsdp2", "deepspeed_zero3", *TESSERA]
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "tessera_dp"]  # stage 0 ~ DDP; on request
HEADLINE_STAGES = {1: "tessera_zero1", 2: "tessera_zero2", 3: "tessera_zero3"}


def deepspeed_config(cfg: TrainBenchConfig, micro_batch: int) -> dict:
    """ZeRO-3 as DeepSpeed's HuggingFace integration configures it for a model of hidden size
    h ("auto" values): reduce bucket h^2, prefetch bucket 0.9 h^2, parameters under 10 h
    elements kept whole; overlap_comm and contiguous_gradients on; live-parameter, reuse
    distance and sub-group limits at 1e9."""
    h = cfg.n_embd
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": int(1e9),
            "sub_group_size": int(1e9),
        },
    }


def _model(cfg: TrainBenchConfig) -> nn.Module:
    return gpt2_lm(vocab=cfg.vocab, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head, seq=cfg.seq)


def _batches(cfg: TrainBenchConfig) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, cfg.vocab, (cfg.global_batch, cfg.seq), generator=g)
        for _ in range(cfg.warmup + cfg.steps)
    ]


def _import_everything() -> None:
    """Every library any variant uses (and the modules they load on first use), before the
    memory baseline, in every variant: imports are not training memory."""
    import transformers  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import tessera.train.boost  # noqa: F401

    try:
        import deepspeed  # noqa: F401
        import deepspeed.runtime.engine  # noqa: F401
        import deepspeed.runtime.zero.stage3  # noqa: F401
    except ImportError:
        pass


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _optimizer_tensors(optimizer) -> list:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def state_bytes(roots: dict[str, list]) -> dict[str, int]:
    """Bytes of the distinct storages behind each kind's tensors (a storage counted under the
    first kind that holds it; a freed storage counts 0)."""
    seen, out = set(), {}
    for kind, tensors in roots.items():
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = _local(t).untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        out[kind] = total
    return out


def _tessera(model, cfg, variant, world, rank):
    import tessera
    from tessera.runtime import Mesh

    plan = tessera.Plan(dp=world, **TESSERA[variant])
    mesh = Mesh(dp=world)
    model, opt = tessera.boost(model, torch.optim.AdamW(model.parameters(), lr=LR), plan, mesh)

    def step(tokens):
        return opt.train_step(tokens, causal_lm_loss)["loss"]

    def roots():
        params = list(model.parameters())
        return {
            "params": [_local(p) for p in params] + opt.engine.shards,
            "grads": [p.grad for p in params] + [s.grad for s in opt.engine.shards],
            "optimizer": _optimizer_tensors(opt.inner),
        }

    return step, roots, mesh.comm.ledger, len(opt.engine.groups)


def _deepspeed(model, cfg, variant, world, rank):
    import deepspeed

    local = cfg.global_batch // world
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
        config=deepspeed_config(cfg, local),
    )

    def step(tokens):
        loss = causal_lm_loss(engine, tokens[rank * local : (rank + 1) * local])
        engine.backward(loss)
        engine.step()
        return loss.item()

    def roots():
        zero = engine.optimizer
        params = list(engine.module.parameters())
        flat32 = list(getattr(zero, "fp32_partitioned_groups_flat", []))
        return {
            "params": [getattr(p, "ds_tensor", None) for p in params]
            + [p.data for p in params]
            + list(getattr(zero, "fp16_partitioned_groups_flat", []))
            + flat32,
            "grads": [getattr(zero, "grad_partitions_flat_buffer", None)] + [t.grad for t in flat32],
            "optimizer": _optimizer_tensors(zero.optimizer),
        }

    return step, roots, None, None


def _torch(model, cfg, variant, world, rank):
    local = cfg.global_batch // world
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
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)

    def step(tokens):
        opt.zero_grad()
        loss = causal_lm_loss(wrapped, tokens[rank * local : (rank + 1) * local])
        loss.backward()
        opt.step()
        return loss.item()

    def roots():
        params = list(model.parameters())
        return {
            "params": params,
            "grads": [p.grad for p in params],
            "optimizer": _optimizer_tensors(opt),
        }

    return step, roots, None, None


def _rank_run(variant: str, cfg: TrainBenchConfig) -> dict:
    import torch.distributed as dist

    _import_everything()
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches(cfg)
    gc.collect()
    before = reset_peak_rss()
    model = _model(cfg)
    setup = _tessera if variant in TESSERA else _deepspeed if variant == "deepspeed_zero3" else _torch
    step, roots, ledger, chunks = setup(model, cfg, variant, world, rank)
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
        "state_bytes": state_bytes(roots()),
        "chunks": chunks,
        "comm_bytes_per_step": {k: v["bytes"] / cfg.steps for k, v in comm.items()},
    }


def _spread(values: list[float]) -> dict:
    """Median, range and the range as a percentage of the median (of the largest value when the
    median is 0: a --quick model's peak can stay inside the resident set taken as its baseline)."""
    mid = statistics.median(values)
    width = max(values) - min(values)
    return {
        "median": mid,
        "min": min(values),
        "max": max(values),
        "spread_pct": 100 * width / (mid or max(values) or 1.0),
    }


def _row(variant: str, repeats: list[list[dict]], cfg: TrainBenchConfig, params: int, peak: float) -> dict:
    tokens = cfg.global_batch * cfg.seq * cfg.steps
    speeds = [tokens / max(r["seconds"] for r in ranks) for ranks in repeats]
    mems = [max(r["peak_mib"] for r in ranks) for ranks in repeats]
    state = {k: max(r["state_bytes"][k] for r in repeats[0]) / MiB for k in ("params", "grads", "optimizer")}
    speed, mem = _spread(speeds), _spread(mems)
    achieved = speed["median"] * flops_per_token(params, cfg.n_layer, cfg.n_embd, cfg.seq)
    return {
        "variant": variant,
        "tokens_per_s": round(speed["median"], 1),
        "tokens_per_s_range": [round(speed["min"], 1), round(speed["max"], 1)],
        "tokens_per_s_spread_pct": round(speed["spread_pct"], 1),
        "peak_mib_per_rank": round(mem["median"], 1),
        "peak_mib_range": [round(mem["min"], 1), round(mem["max"], 1)],
        "model_state_mib_per_rank": round(sum(state.values()), 1),
        "params_mib": round(state["params"], 1),
        "grads_mib": round(state["grads"], 1),
        "optimizer_mib": round(state["optimizer"], 1),
        "chunks_per_rank": repeats[0][0]["chunks"],
        "achieved_gflops": round(achieved / 1e9, 2),
        "mfu": round(achieved / peak, 4),
        "final_loss": statistics.mean(r["loss"] for r in repeats[0]),  # mean over the ranks' shares
        "comm_mib_per_step": {k: round(v / MiB, 2) for k, v in repeats[0][0]["comm_bytes_per_step"].items()},
        "speeds": speeds,
        "mems": mems,
    }


def _headline(by: dict[str, dict]) -> dict:
    """Tessera ZeRO-1/2/3 over FSDP2 and over DeepSpeed: ratio of the medians, and the range of
    the per-repeat ratios (repeats are interleaved, so repeat i of both ran side by side)."""
    out = {}
    for stage, variant in HEADLINE_STAGES.items():
        for base in ("fsdp2", "deepspeed_zero3"):
            if variant not in by or base not in by:
                continue
            for metric, key in (("tokens_per_s", "speeds"), ("peak_mem", "mems")):
                column = "tokens_per_s" if metric == "tokens_per_s" else "peak_mib_per_rank"
                name = f"zero{stage}_{metric}_vs_{base}"
                if by[base][column] <= 0 or min(by[base][key]) <= 0:
                    # a tiny (--quick) model's peak can stay within the baseline's resident set:
                    # no ratio to give
                    out[name] = out[name + "_range"] = None
                    continue
                ratios = [a / b for a, b in zip(by[variant][key], by[base][key], strict=True)]
                out[name] = round(by[variant][column] / by[base][column], 3)
                out[name + "_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return out


def run_train_bench(
    *, quick: bool, progress: bool = True, variants: list[str] | None = None, checkpoints: bool = True
) -> BenchResult:
    """The variants' throughput and memory, then (``checkpoints``) the checkpoint section:
    ``tessera.bench.checkpoint.measure`` (tokens/s with synchronous and background checkpoints,
    a killed rank's recovery), its headline keys prefixed ``checkpoint_``."""
    from tessera.bench import checkpoint
    from tessera.runtime import spawn

    cfg = QUICK if quick else FULL
    unknown = set(variants or []) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown train bench variants {sorted(unknown)}; known: {VARIANTS}")
    try:
        import deepspeed  # noqa: F401

        have_deepspeed = True
    except ImportError:
        have_deepspeed = False
    chosen = [v for v in variants or DEFAULT_VARIANTS if v != "deepspeed_zero3" or have_deepspeed]
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # the ranks inherit it
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.abspath(".cache/torch_extensions"))
    params = sum(p.numel() for p in _model(cfg).parameters())
    peak = matmul_peak_flops() * RANKS
    runs: dict[str, list] = {v: [] for v in chosen}
    with tqdm(total=cfg.repeats * len(chosen), desc="train variants", disable=not progress) as bar:
        for _ in range(cfg.repeats):  # interleaved: every variant once, then again
            for variant in chosen:
                runs[variant].append(spawn(_rank_run, RANKS, variant, cfg, timeout_s=1800))
                bar.update(1)
    rows = [_row(v, runs[v], cfg, params, peak) for v in chosen]
    by = {r["variant"]: r for r in rows}
    headline = _headline(by)
    for row in rows:
        del row["speeds"], row["mems"]
    notes, tables, extra = _notes(cfg, params, peak, have_deepspeed), [], {}
    if checkpoints:
        part = checkpoint.measure(checkpoint.QUICK if quick else checkpoint.FULL, progress)
        headline |= {f"checkpoint_{k}": v for k, v in part["headline"].items()}
        notes += [f"Checkpoints: {n}" for n in part["notes"]]
        tables.append(
            ("Checkpoints: tokens/s with a checkpoint every N steps", checkpoint.ROW_COLUMNS, part["rows"])
        )
        if part["recovery"]:
            tables.append(("Checkpoints: from a killed rank to the first step after restart",
                           list(part["recovery"][0]), part["recovery"]))  # fmt: skip
        extra["checkpoint"] = {"rows": part["rows"], **part["extra"]}
    return BenchResult(
        name="train",
        headline=headline,
        rows=rows,
        columns=[
            "variant",
            "tokens_per_s",
            "tokens_per_s_range",
            "peak_mib_per_rank",
            "peak_mib_range",
            "model_state_mib_per_rank",
            "params_mib",
            "grads_mib",
            "optimizer_mib",
            "chunks_per_rank",
            "mfu",
            "final_loss",
            "comm_mib_per_step",
        ],
        notes=notes,
        extra={
            "config": asdict(cfg),
            "parameters": params,
            "deepspeed_config": deepspeed_config(cfg, cfg.global_batch // RANKS),
            "tessera_plans": TESSERA,
            **extra,
        },
        tables=tables,
    )


def _notes(cfg: TrainBenchConfig, params: int, peak: float, have_deepspeed: bool) -> list[str]:
    zero = deepspeed_config(cfg, cfg.global_batch // RANKS)["zero_optimization"]
    notes = [
        f"GPT-2 ({cfg.n_layer} layers, {cfg.n_embd} wide, {cfg.n_head} heads, vocab {cfg.vocab}, {params:,} parameters), "
        f"sequence {cfg.seq}, global batch {cfg.global_batch}, AdamW (lr {LR}), fp32; {RANKS} gloo ranks x 1 thread; "
        f"{cfg.warmup} warm-up + {cfg.steps} timed steps; {cfg.repeats} interleaved repeats: median, [min, max].",
        "FSDP2: fully_shard per transformer block and the root. Tessera: block_chunks (a chunk per block, "
        "the rest as FSDP2's root holds it), and ZeRO-3 also with 32 MiB chunks across blocks (tessera_zero3_32mib).",
        "DeepSpeed ZeRO-3 (its HuggingFace integration's values for hidden size h): "
        + ", ".join(f"{k}={v}" for k, v in zero.items() if k != "stage"),
        f"MFU against a measured fp32 matmul peak of {peak / 1e9:.1f} GFLOP/s ({RANKS} ranks x 1 thread).",
        "peak_mib_per_rank: resident high-water mark above a baseline taken after every import (torch, "
        "transformers, DeepSpeed) and before the model is built. params/grads/optimizer_mib: bytes of the "
        "distinct storages each framework holds after a step, counted exactly (communication buckets, "
        "activations and allocator slack are not model state).",
    ]
    if not have_deepspeed:
        notes.append(
            "DeepSpeed is not installed (optional extra: pip install '.[deepspeed]'): its row is absent."
        )
    return notes


def plot_train(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows
    names = [r["variant"] for r in rows]
    colors = ["#1f77b4" if n.startswith("tessera") else "#7f7f7f" for n in names]
    from tessera.bench.checkpoint import draw

    section = result.extra.get("checkpoint")
    fig = plt.figure(figsize=(15, 8.5 if section else 4.5))
    top = fig.add_gridspec(2 if section else 1, 3)
    ax_t = fig.add_subplot(top[0, 0])
    ax_m, ax_s = fig.add_subplot(top[0, 1], sharey=ax_t), fig.add_subplot(top[0, 2], sharey=ax_t)
    for ax in (ax_m, ax_s):
        ax.tick_params(labelleft=False)
    if section:
        draw(fig.add_subplot(top[1, 0]), fig.add_subplot(top[1, 1]), section["rows"], section["recovery"])
    speed = [r["tokens_per_s"] for r in rows]
    err = [
        [s - r["tokens_per_s_range"][0] for s, r in zip(speed, rows, strict=True)],
        [r["tokens_per_s_range"][1] - s for s, r in zip(speed, rows, strict=True)],
    ]
    ax_t.barh(names, speed, xerr=err, color=colors)
    ax_t.set(title="training throughput (median, range)", xlabel=f"tokens / s ({RANKS} ranks)")
    ax_m.barh(names, [r["peak_mib_per_rank"] for r in rows], color=colors)
    ax_m.set(title="peak resident memory per rank", xlabel="MiB above the post-import baseline")
    left = [0.0] * len(rows)
    for kind, color in (("params_mib", "#4c72b0"), ("grads_mib", "#dd8452"), ("optimizer_mib", "#55a868")):
        values = [r[kind] for r in rows]
        ax_s.barh(names, values, left=left, color=color, label=kind.removesuffix("_mib"))
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax_s.set(title="model state per rank", xlabel="MiB")
    ax_s.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
