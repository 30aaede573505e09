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
GPT-2, 1 repeat, about a minute. The sizes and variants are ``train_config``; the rows,
headline, notes and plot ``train_report``.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import asdict

import torch
from torch import nn
from tqdm.auto import tqdm

from tessera.bench.harness import BenchResult, matmul_peak_flops
from tessera.bench.train_config import (  # noqa: F401  (QUICK, FULL, VARIANTS: this benchmark's API)
    DEFAULT_VARIANTS,
    FULL,
    LR,
    QUICK,
    RANKS,
    TESSERA,
    VARIANTS,
    MiB,
    TrainBenchConfig,
    deepspeed_config,
)
from tessera.bench.train_report import _headline, _notes, _row, _spread, plot_train  # noqa: F401  (re-exported)
from tessera.memory.track import reset_peak_rss, status_kib
from tessera.train.gpt2_text import gpt2_lm
from tessera.train.losses import causal_lm_loss


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
