"""What checkpoints cost a training run, and what a lost rank costs it: the checkpoint section
of ``tessera bench train``, and alone as ``tessera bench checkpoint`` (issue #33).

Throughput: a GPT-2 (HuggingFace class, sizes below) trained by 2 gloo ranks at ZeRO-3, with
no checkpoints (the baseline, in the same run), with a checkpoint every ``every`` steps
written synchronously (``tessera.train.resume_or_start(..., background=False)``: the step
waits for DCP's write and the commit) and written in the background (the default: a copy at
the step boundary, DCP's ``async_save`` over a gloo group of its own, the commit after every
rank's part is on disk). Interleaved repeats (every variant once, then again), each in
fresh processes; tokens/s over the timed steps, the last background save waited for inside
the timed window; the overhead is 1 - tokens/s over the baseline's, per repeat, median and
range. Also the time a save blocks the training loop (the ``maybe_save`` call), median.

Recovery: the same model under ``tessera launch --max-restarts 1 --checkpoint-dir DIR`` (this
module's ``__main__``); rank 1 SIGKILLs itself after step ``kill_at``; torchrun's agent
notices, ends rank 0, starts both again; they join a new group, load the newest committed
checkpoint and train. Measured from the kill to the end of the first step after it, split
into: kill -> restarted process running, -> imports done, -> group joined, -> checkpoint
loaded, -> first step done.
"""

from __future__ import annotations

import time

_STARTED = time.time()  # a restarted worker's first moment (before its imports)

import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from tessera.bench.harness import BenchResult  # noqa: E402

RANKS = 2


@dataclass(frozen=True)
class CheckpointBenchConfig:
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 4
    vocab: int = 4096
    seq: int = 128
    batch: int = 8
    warmup: int = 2
    steps: int = 40
    every: int = 10
    repeats: int = 3
    kills: int = 2


FULL = CheckpointBenchConfig()
QUICK = CheckpointBenchConfig(
    n_embd=128, n_layer=2, n_head=4, vocab=1024, seq=64, warmup=1, steps=20, every=5, repeats=1, kills=1
)
VARIANTS = ("none", "sync", "async")


def _build(cfg: CheckpointBenchConfig):
    import tessera
    from tessera.train.gpt2_text import gpt2_lm

    model = gpt2_lm(vocab=cfg.vocab, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head, seq=cfg.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return tessera.boost(model, optimizer, tessera.Plan(dp=RANKS, zero=3))


def _batch(cfg: CheckpointBenchConfig, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)


def _rank_run(cfg: CheckpointBenchConfig, variant: str, folder: str) -> dict:
    import torch.distributed as dist

    import tessera
    from tessera.train.losses import causal_lm_loss

    model, opt = _build(cfg)
    ckpt = None
    if variant != "none":
        ckpt = tessera.train.resume_or_start(
            model, opt, folder, every=cfg.every, background=variant == "async"
        )
    for step in range(cfg.warmup):
        opt.train_step(_batch(cfg, step), causal_lm_loss)
    dist.barrier()
    began, blocked = time.perf_counter(), []
    for step in range(cfg.warmup, cfg.warmup + cfg.steps):
        opt.train_step(_batch(cfg, step), causal_lm_loss)
        if ckpt is not None and ckpt.due(step + 1 - cfg.warmup):
            t = time.perf_counter()
            ckpt.save(step + 1)
            blocked.append(time.perf_counter() - t)
    if ckpt is not None:
        ckpt.wait()
    dist.barrier()
    return {"seconds": time.perf_counter() - began, "blocked": blocked}


def _checkpoint_mib(folder: Path) -> float:
    from tessera.train.resume import latest

    found = latest(folder)
    return sum(f.stat().st_size for f in found.iterdir()) / 2**20 if found else 0.0


def _throughput(cfg: CheckpointBenchConfig, progress: bool) -> tuple[list[dict], dict]:
    from tqdm.auto import tqdm

    from tessera.runtime import spawn

    runs: dict[str, list] = {v: [] for v in VARIANTS}
    sizes = []
    with tqdm(total=cfg.repeats * len(VARIANTS), desc="checkpoint variants", disable=not progress) as bar:
        for _ in range(cfg.repeats):
            for variant in VARIANTS:
                with tempfile.TemporaryDirectory() as folder:
                    runs[variant].append(spawn(_rank_run, RANKS, cfg, variant, folder, timeout_s=1800))
                    if variant != "none":
                        sizes.append(_checkpoint_mib(Path(folder)))
                bar.update(1)
    tokens = cfg.batch * cfg.seq * cfg.steps
    speeds = {v: [tokens / max(r["seconds"] for r in ranks) for ranks in runs[v]] for v in VARIANTS}
    rows = []
    for v in VARIANTS:
        overheads = [1 - a / b for a, b in zip(speeds[v], speeds["none"], strict=True)]
        blocked = [b for ranks in runs[v] for r in ranks for b in r["blocked"]]
        rows.append(
            {
                "variant": v,
                "tokens_per_s": round(statistics.median(speeds[v]), 1),
                "tokens_per_s_range": [round(min(speeds[v]), 1), round(max(speeds[v]), 1)],
                "overhead_pct": round(100 * statistics.median(overheads), 2),
                "overhead_pct_range": [round(100 * min(overheads), 2), round(100 * max(overheads), 2)],
                "saves": len(runs[v][0][0]["blocked"]),
                "blocked_ms_per_save": round(1000 * statistics.median(blocked), 1) if blocked else 0.0,
            }
        )
    return rows, {"checkpoint_mib": round(statistics.median(sizes), 2) if sizes else 0.0}


# ---- recovery: a worker under `tessera launch --max-restarts 1` ---------------------------------


def _worker_main() -> None:
    """``python -m tessera.bench.checkpoint STEPS KILL_AT N_EMBD N_LAYER N_HEAD VOCAB SEQ``
    under tessera launch --max-restarts 1 --checkpoint-dir DIR --checkpoint-every E."""
    import signal

    import torch.distributed as dist

    import tessera
    from tessera.runtime import init_from_env
    from tessera.train.losses import causal_lm_loss

    imported = time.time()
    steps, kill_at, n_embd, n_layer, n_head, vocab, seq = (int(a) for a in sys.argv[1:8])
    cfg = CheckpointBenchConfig(n_embd=n_embd, n_layer=n_layer, n_head=n_head, vocab=vocab, seq=seq)
    init_from_env(timeout_s=120)
    joined = time.time()
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model, opt = _build(cfg)
    ckpt = tessera.train.resume_or_start(model, opt)
    loaded = time.time()
    folder = ckpt.directory
    for step in range(ckpt.step, steps):
        opt.train_step(_batch(cfg, step), causal_lm_loss)
        if attempt > 0 and rank == 0 and step == ckpt.step:
            moments = {"started": _STARTED, "imported": imported, "joined": joined, "loaded": loaded}
            record = {**moments, "first_step_done": time.time(), "resumed_from": ckpt.step}
            (folder / "restart.json").write_text(json.dumps(record))
        if attempt == 0 and rank == 1 and step + 1 == kill_at:
            (folder / "kill.json").write_text(json.dumps({"killed": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.maybe_save(step + 1)
    ckpt.wait()
    dist.barrier()
    dist.destroy_process_group()


def _recovery(cfg: CheckpointBenchConfig, progress: bool) -> list[dict]:
    steps, every = 12, 4
    kill_at = 7  # after the step-4 commit; its step-8 checkpoint never happens
    out = []
    for _ in range(cfg.kills):
        with tempfile.TemporaryDirectory() as folder:
            command = [sys.executable, "-m", "tessera.cli", "launch", "-n", str(RANKS), "--max-restarts", "1"]
            command += ["--checkpoint-dir", folder, "--checkpoint-every", str(every), "-m", __name__]
            command += [
                str(v) for v in (steps, kill_at, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab, cfg.seq)
            ]
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"the recovery run failed:\n{done.stderr[-3000:]}")
            killed = json.loads((Path(folder) / "kill.json").read_text())["killed"]
            r = json.loads((Path(folder) / "restart.json").read_text())
            out.append(
                {
                    "kill_to_first_step_s": round(r["first_step_done"] - killed, 2),
                    "kill_to_process_s": round(r["started"] - killed, 2),
                    "imports_s": round(r["imported"] - r["started"], 2),
                    "join_s": round(r["joined"] - r["imported"], 2),
                    "build_and_load_s": round(r["loaded"] - r["joined"], 2),
                    "first_step_s": round(r["first_step_done"] - r["loaded"], 2),
                    "resumed_from": r["resumed_from"],
                }
            )
        if progress:
            print(
                f"recovery: {out[-1]['kill_to_first_step_s']} s from the kill to the first step", flush=True
            )
    return out


def measure(cfg: CheckpointBenchConfig, progress: bool = True) -> dict:
    """The throughput and recovery measurements, for ``tessera bench checkpoint`` and as the
    checkpoint section of ``tessera bench train``: {headline, rows, recovery, notes, extra}."""
    from tessera.train.gpt2_text import gpt2_lm

    params = sum(p.numel() for p in gpt2_lm(vocab=cfg.vocab, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                                           n_head=cfg.n_head, seq=cfg.seq).parameters())  # fmt: skip
    rows, sizes = _throughput(cfg, progress)
    recovery = _recovery(cfg, progress) if cfg.kills else []
    by = {r["variant"]: r for r in rows}
    kill = [r["kill_to_first_step_s"] for r in recovery]
    # what a save costs the loop directly: its blocked time over the training time between two
    # saves at the baseline's speed (robust where other jobs' load makes tokens/s noisy)
    interval_s = cfg.every * cfg.batch * cfg.seq / by["none"]["tokens_per_s"]
    for row in rows:
        row["blocked_pct_of_interval"] = round(100 * row["blocked_ms_per_save"] / 1000 / interval_s, 2)
    headline = {
        "async_overhead_pct": by["async"]["overhead_pct"],
        "async_overhead_pct_range": by["async"]["overhead_pct_range"],
        "sync_overhead_pct": by["sync"]["overhead_pct"],
        "sync_overhead_pct_range": by["sync"]["overhead_pct_range"],
        "async_blocked_ms_per_save": by["async"]["blocked_ms_per_save"],
        "sync_blocked_ms_per_save": by["sync"]["blocked_ms_per_save"],
        "async_blocked_pct_of_interval": by["async"]["blocked_pct_of_interval"],
        "sync_blocked_pct_of_interval": by["sync"]["blocked_pct_of_interval"],
        "interval_s": round(interval_s, 2),
    }
    if kill:
        headline["kill_to_first_step_s"] = round(statistics.median(kill), 2)
        headline["kill_to_first_step_s_range"] = [min(kill), max(kill)]
    notes = [
        f"GPT-2 ({cfg.n_layer} layers, {cfg.n_embd} wide, vocab {cfg.vocab}, {params:,} parameters), "
        f"sequence {cfg.seq}, batch {cfg.batch}, AdamW, fp32, ZeRO-3 over {RANKS} gloo ranks x 1 thread; "
        f"a checkpoint ({sizes['checkpoint_mib']} MiB on disk) every {cfg.every} of {cfg.steps} timed steps "
        f"after {cfg.warmup} warm-up; {cfg.repeats} interleaved repeat(s): median, [min, max]; overhead = "
        "1 - tokens/s over the no-checkpoint run of the same repeat.",
        "sync: the loop waits for DCP's write and the commit; async: a copy at the step boundary, then "
        "dcp.async_save and the commit in the background (the last one waited for inside the timed window).",
        f"blocked_pct_of_interval: the time a save blocks the loop over the training time between two saves "
        f"({interval_s:.2f} s at the baseline's median tokens/s).",
    ]
    if kill:
        notes.append(
            "Recovery: rank 1 SIGKILLed after step 7 under tessera launch --max-restarts 1 (checkpoints every 4 "
            "steps); from the kill to the end of the first step after the restart, and its parts."
        )
    extra = {"config": asdict(cfg), "parameters": params, "recovery": recovery, **sizes}
    return {"headline": headline, "rows": rows, "recovery": recovery, "notes": notes, "extra": extra}


ROW_COLUMNS = [
    "variant", "tokens_per_s", "tokens_per_s_range", "overhead_pct", "overhead_pct_range", "saves",
    "blocked_ms_per_save", "blocked_pct_of_interval",
]  # fmt: skip


def run_checkpoint_bench(*, quick: bool, progress: bool = True) -> BenchResult:
    part = measure(QUICK if quick else FULL, progress)
    recovery = part["recovery"]
    return BenchResult(
        name="checkpoint",
        headline=part["headline"],
        rows=part["rows"],
        columns=ROW_COLUMNS,
        notes=part["notes"],
        extra=part["extra"],
        tables=[("Recovery from a killed rank", list(recovery[0]), recovery)] if recovery else [],
    )


def draw(ax_t, ax_r, rows: list[dict], recovery: list[dict]) -> None:
    """The two panels: tokens/s per variant, and a kill's recovery time in parts."""
    names = [r["variant"] for r in rows]
    speed = [r["tokens_per_s"] for r in rows]
    err = [
        [s - r["tokens_per_s_range"][0] for s, r in zip(speed, rows, strict=True)],
        [r["tokens_per_s_range"][1] - s for s, r in zip(speed, rows, strict=True)],
    ]
    ax_t.barh(names, speed, xerr=err, color=["#7f7f7f", "#dd8452", "#1f77b4"])
    ax_t.set(title="throughput with a checkpoint every N steps", xlabel="tokens / s (median, range)")
    parts = ["kill_to_process_s", "imports_s", "join_s", "build_and_load_s", "first_step_s"]
    left = [0.0] * len(recovery)
    labels = [f"kill {i + 1}" for i in range(len(recovery))]
    for part in parts:
        values = [r[part] for r in recovery]
        ax_r.barh(labels, values, left=left, label=part.removesuffix("_s"))
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax_r.set(title="from a killed rank to the first step after restart", xlabel="seconds")
    if recovery:
        ax_r.legend(fontsize=8)


def plot_checkpoint(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    draw(ax_t, ax_r, result.rows, result.extra["recovery"])
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    _worker_main()
