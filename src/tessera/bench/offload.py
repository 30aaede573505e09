"""`tessera bench offload`: the largest GPT-2-family model that trains under one fixed host
memory budget, without offload, with static offload (ZeRO-Offload/Infinity style:
everything but the working set on disk), with DeepSpeed ZeRO-3 offload (the optional
extra; to disk where its async I/O builds, else to host memory) and with Tessera's
planned placement (trace, Belady eviction, prefetch). At one common size every variant
fits: tokens/s and bytes moved per step.

Each trial is a fresh process (``track.fresh_process_env``: freed blocks go back to the
OS). The budget is checked by the measured resident high-water mark (VmHWM) of the
training steps, warm-up step included, and of set-up: a trial passes only if its steps
complete and both marks stay under the budget (a hard limit too, where the machine allows:
``memory_limit.HardLimit``). No variant builds the model whole: Tessera's are built on the meta
device (accelerate's ``init_empty_weights``) and made chunk by chunk by ``boost``
(``tessera.train.meta_model``); DeepSpeed's are partitioned as they are built
(``deepspeed.zero.Init`` through transformers' ``HfDeepSpeedConfig``, the way transformers
documents ZeRO-3 model creation). Depth climbs a ladder to the first miss, then is bisected
between the last fit and that miss. Tessera's offloaded variants get ``host_memory`` = the budget less the process's
resident memory before the model is built, less the activations (measured first: one
forward at the ladder's two smallest depths gives bytes fixed + per layer; x1.1), less
three chunks of slack; once ``boost`` is done, what setup left resident beside the chunks
comes off too (``TieredStore.set_budget``). The high-water mark then says whether that
arithmetic held.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

from tessera.bench.offload_deepspeed import build_deepspeed_ops, deepspeed_step, have_deepspeed
from tessera.bench.offload_report import VARIANTS, params_of, plot_offload, result

MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class OffloadBenchConfig:
    budget_mib: int = 1400
    width: int = 512
    heads: int = 8
    vocab: int = 8192
    seq: int = 128
    batch: int = 2
    depths: tuple[int, ...] = (2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64)
    common_depth: int = 4
    common_steps: int = 6  # the common size is timed again, in runs of its own, after the ladders
    steps: int = 3  # the first is the warm-up (Tessera's trace); tokens/s over the rest
    chunk_mib: float = 16.0  # >= the 8192 x 512 token embedding (16 MiB): one block per chunk
    threads: int = 2
    # recompute each block in backward (HF's own checkpointing), every variant alike. Off by
    # default: a full ladder with it outlasts 15 minutes here (depth 64 offloaded: 110 s a trial)
    activation_checkpointing: bool = False
    trial_timeout_s: float = 240.0
    variant_budget_s: float = 300.0  # a variant's ladder stops climbing past this (said so)
    # activation bytes, measured by a probe before the ladder (None: the dry run's estimate)
    act_fixed_mib: float | None = None
    act_per_layer_mib: float | None = None


FULL = OffloadBenchConfig()
QUICK = OffloadBenchConfig(
    budget_mib=700,
    width=128,
    heads=4,
    vocab=1024,
    depths=(1, 2, 4, 8),
    common_depth=1,
    steps=2,
    chunk_mib=1.0,
)


# ---- one trial, in a fresh process ------------------------------------------------------------


def _config(cfg: OffloadBenchConfig, depth: int):
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=depth, n_embd=cfg.width, n_head=cfg.heads, vocab_size=cfg.vocab, n_positions=cfg.seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip


def _model(cfg: OffloadBenchConfig, depth: int, *, meta: bool = False):
    """GPT-2 of ``depth`` layers; ``meta``: parameters on the meta device (buffers real), the
    embeddings tied as transformers ties them after loading."""
    import accelerate
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    if not meta:
        return GPT2LMHeadModel(_config(cfg, depth))
    with accelerate.init_empty_weights():
        model = GPT2LMHeadModel(_config(cfg, depth))
    model.tie_weights()
    return model


def _tessera_step(cfg, depth, variant, base_rss, workdir):
    import torch

    import tessera
    from tessera.memory.dry_run import estimate_gpt2_activations
    from tessera.memory.track import resident_bytes
    from tessera.train.losses import causal_lm_loss

    model = _model(cfg, depth, meta=variant != "probe")  # made chunk by chunk by boost
    kwargs, host = {}, None
    if variant not in ("none", "probe"):
        if cfg.act_per_layer_mib is not None:
            acts = (cfg.act_fixed_mib + depth * cfg.act_per_layer_mib) * MiB
        else:
            acts = estimate_gpt2_activations(
                layers=depth, width=cfg.width, heads=cfg.heads, vocab=cfg.vocab, batch=cfg.batch, seq=cfg.seq
            )
        host = int(cfg.budget_mib * MiB - base_rss - 1.1 * acts - 3 * cfg.chunk_mib * MiB)
        kwargs = dict(offload="static" if variant == "static" else "auto", host_memory=max(host, 1))
        kwargs["offload_dir"] = str(workdir)
    plan = tessera.Plan(
        zero=3, chunk_mib=cfg.chunk_mib, block_chunks=True, activation_checkpointing=cfg.activation_checkpointing,
        precision="bf16" if variant.endswith("_bf16") else "fp32", **kwargs,
    )  # fmt: skip
    model, opt = tessera.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), plan)
    if opt.engine.offload is not None:
        # what setup left resident beside the chunks (module objects, small blocks the C
        # allocator keeps) comes out of the chunks' share too
        store = opt.engine.offload.store
        host -= max(0, resident_bytes() - base_rss - store.tiers[0].used)
        opt.engine.offload.set_budget(max(host, 1))  # refused, with the numbers, below one chunk's use
    if variant == "probe":  # activations of one forward: the resident peak it adds
        from tessera.memory.track import rss_peak_during
        from tessera.train.losses import causal_lm_loss as loss_of

        def step(tokens):
            return rss_peak_during(lambda: loss_of(model, tokens))[0]

        return step, lambda: None, None

    def step(tokens):
        return opt.train_step(tokens, causal_lm_loss)["loss"]

    def moved():
        return opt.engine.offload.moved() if opt.engine.offload is not None else None

    return step, moved, host


def trial(cfg: OffloadBenchConfig, depth: int, variant: str) -> dict:
    """One variant at one depth (run in a fresh process): peak RSS of the steps, setup peak,
    tokens/s, bytes moved per step."""
    import torch

    from tessera.memory.track import peak_resident_bytes, reset_peak_rss, resident_bytes

    torch.set_num_threads(cfg.threads)
    if variant.startswith("deepspeed"):
        _common_setup()  # a no-op in a trial's own process, which did it first
    base = resident_bytes()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g) for _ in range(cfg.steps)]
    with tempfile.TemporaryDirectory(
        prefix="tessera-offload-", dir=os.environ.get("TESSERA_OFFLOAD_DIR")
    ) as work:
        if variant.startswith("deepspeed"):
            step, moved, where = deepspeed_step(
                cfg,
                _config(cfg, depth),
                work,
                bf16=variant.endswith("_bf16"),
                whole=variant.endswith("_whole"),
            )
            host = None
        else:
            step, moved, host = _tessera_step(cfg, depth, variant, base, work)
            where = "disk" if variant != "none" else None
        setup_peak = peak_resident_bytes()
        reset_peak_rss()
        loss = step(batches[0])
        first = moved()
        began = time.perf_counter()
        for tokens in batches[1:]:
            loss = step(tokens)
        seconds = time.perf_counter() - began
        last = moved()
    timed = cfg.steps - 1
    per_step = None
    if first is not None and timed:
        per_step = (last["read"] + last["written"] - first["read"] - first["written"]) / timed
    return {
        "peak_mib": peak_resident_bytes() / MiB,
        "setup_peak_mib": setup_peak / MiB,
        "base_mib": base / MiB,
        "tokens_per_s": timed * cfg.batch * cfg.seq / seconds if timed else None,
        "moved_mib_per_step": None if per_step is None else per_step / MiB,
        "host_memory_mib": None if host is None else host / MiB,
        "offload_to": where,
        "loss": loss,  # the probe: bytes its forward added
    }


def _common_setup() -> None:
    """The same for every variant, before its baseline: the imports (DeepSpeed's too, where it
    is installed) and a one-rank process group, so that no variant's runtime counts against
    its budget and another's does not."""
    import torch.distributed as dist
    import transformers  # noqa: F401

    if have_deepspeed():
        import deepspeed  # noqa: F401
    if not dist.is_initialized():
        store = tempfile.mkdtemp(prefix="tessera-pg-")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=0, world_size=1)


def _child_main() -> None:
    _common_setup()
    spec = json.loads(sys.argv[1])
    cfg = OffloadBenchConfig(**{**spec["cfg"], "depths": tuple(spec["cfg"]["depths"])})
    print("RESULT " + json.dumps(trial(cfg, spec["depth"], spec["variant"])), flush=True)


def _run_trial(cfg: OffloadBenchConfig, depth: int, variant: str) -> dict:
    """One trial in a fresh process, under the budget as a hard limit where the machine allows
    one (``memory_limit.HardLimit``: set-up included; passing it kills the trial), and checked
    by the steps' resident high-water mark either way."""
    from tessera.bench.memory_limit import HardLimit
    from tessera.memory.track import fresh_process_env

    spec = json.dumps({"cfg": asdict(cfg), "depth": depth, "variant": variant})
    code = "from tessera.bench.offload import _child_main; _child_main()"
    env = fresh_process_env(cfg.threads)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.abspath(".cache/torch_extensions"))
    env["HF_HUB_OFFLINE"] = "1"
    began = time.perf_counter()
    with HardLimit(cfg.budget_mib * MiB) as limit:
        try:
            out = subprocess.run(
                [sys.executable, "-c", code, spec],
                capture_output=True,
                text=True,
                env=env,
                timeout=cfg.trial_timeout_s,
                preexec_fn=limit.preexec,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "why": f"timed out after {cfg.trial_timeout_s:.0f} s", "limit": limit.how}
        charged = limit.peak_bytes()
        killed = limit.killed(out.returncode)
    extra = {"limit": limit.how, "charged_peak_mib": None if charged is None else charged / MiB}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        why = f"killed by the hard limit ({limit.how})" if killed else tail[:200]
        return {"ok": False, "why": why, "wall_s": time.perf_counter() - began, **extra}
    row = json.loads(lines[-1][len("RESULT ") :]) | extra
    row["ok"] = (
        row["peak_mib"] <= cfg.budget_mib and max(row["setup_peak_mib"], row["peak_mib"]) <= cfg.budget_mib
    )
    if not row["ok"]:
        worst = max(row["setup_peak_mib"], row["peak_mib"])
        row["why"] = f"resident peak {worst:.0f} MiB over the {cfg.budget_mib} MiB budget"
    row["wall_s"] = time.perf_counter() - began
    return row


# ---- the ladder -------------------------------------------------------------------------------


def run_offload_bench(cfg: OffloadBenchConfig | None = None, *, quick: bool = False, progress: bool = True):
    cfg = cfg or (QUICK if quick else FULL)
    variants = [v for v in VARIANTS if not v.startswith("deepspeed") or have_deepspeed()]
    if any(v.startswith("deepspeed") for v in variants):  # first: every trial imports DeepSpeed
        build_deepspeed_ops(progress)
    if cfg.act_per_layer_mib is None:
        cfg = _measure_activations(cfg)
    rows, largest = [], {}
    for variant in variants:
        fits = _ladder(cfg, variant, rows, progress)
        if fits is not None:
            largest[variant] = fits
    common = []
    for variant in variants:
        row = {
            "variant": variant,
            "depth": cfg.common_depth,
            "params_m": params_of(cfg, cfg.common_depth) / 1e6,
        }
        row.update(_run_trial(replace(cfg, steps=cfg.common_steps), cfg.common_depth, variant))
        common.append(row)
        if progress:
            print(_progress(row) + " (common size, timed)", file=sys.stderr, flush=True)
    return result(cfg, rows, largest, variants, common)


def _ladder(cfg: OffloadBenchConfig, variant: str, rows: list, progress: bool) -> int | None:
    """Depth up the ladder to the first miss (or the variant's time), then bisected between the
    last depth that fits and that miss; every trial's row appended to ``rows``. The largest
    depth that fits (None: not even the first)."""
    began = time.perf_counter()

    def attempt(depth: int, *, bisecting: bool = False) -> bool:
        row = {"variant": variant, "depth": depth, "params_m": params_of(cfg, depth) / 1e6}
        if bisecting:
            row["bisect"] = True
        row.update(_run_trial(cfg, depth, variant))
        rows.append(row)
        if progress:
            print(_progress(row), file=sys.stderr, flush=True)
        return row["ok"]

    largest, miss = None, None
    for depth in cfg.depths:
        if time.perf_counter() - began > cfg.variant_budget_s:
            rows.append({"variant": variant, "depth": depth, "params_m": params_of(cfg, depth) / 1e6, "ok": False,
                         "why": f"not run: the variant's {cfg.variant_budget_s:.0f} s were spent", "untried": True})  # fmt: skip
            break
        if not attempt(depth):
            miss = depth
            break
        largest = depth
    low, high = largest or 0, miss
    while high is not None and high - low > 1:
        mid = (low + high) // 2
        if attempt(mid, bisecting=True):
            low = largest = mid
        else:
            high = mid
    return largest


def _measure_activations(cfg: OffloadBenchConfig) -> OffloadBenchConfig:
    """Activation bytes of a forward at two depths (fresh processes): fixed + per layer, for
    the offloaded variants' arithmetic (the dry run's formula is a published estimate;
    HF GPT-2's fp32 tanh-GELU keeps more)."""
    small, large = cfg.depths[0], cfg.depths[1]
    got = [
        _run_trial(replace(cfg, act_fixed_mib=0.0, act_per_layer_mib=0.0), d, "probe") for d in (small, large)
    ]
    if not all("loss" in g for g in got):
        return cfg  # the estimate stays
    a, b = (g["loss"] / MiB for g in got)
    per_layer = max(0.0, (b - a) / (large - small))
    return replace(cfg, act_fixed_mib=max(0.0, a - per_layer * small), act_per_layer_mib=per_layer)


def _progress(row: dict) -> str:
    what = "ok" if row["ok"] else "MISS: " + row.get("why", "")
    peak = f"{row['peak_mib']:.0f} MiB" if "peak_mib" in row else "-"
    return f"offload bench: {row['variant']:<9} depth {row['depth']:>3} ({row['params_m']:.1f} M) peak {peak} {what}"


__all__ = ["FULL", "QUICK", "OffloadBenchConfig", "plot_offload", "run_offload_bench", "trial"]
