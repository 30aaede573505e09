"""`tessera bench autochunk`: the original module against ``tessera.autochunk`` of it, over
growing lengths, for the AlphaFold2 Evoformer block and a GPT-2 block.

Each (model, length, variant) is measured in two fresh Python processes (2 threads each):
memory with ``MALLOC_MMAP_THRESHOLD_`` set so freed blocks go back to the OS, time with the
default allocator. After one warm-up forward:

- ``rss_mib``: activation memory as the OS sees it — the resident-set high-water mark
  (``VmHWM``, reset through ``/proc/self/clear_refs``) during one forward, minus the
  resident set before it (inputs and weights already there). Allocator and kernel scratch
  included.
- ``tracked_mib``: the peak of live tensor storages the forward allocates, tracked at the
  ATen dispatch level (``tessera.memory.track.TensorMemory``).
- ``estimate_mib``: the planner's estimate (of the traced graph, unchunked or chunked).
- ``seconds``: the best of a few timed forwards (no_grad), in a second fresh process with
  the default allocator.

The budget headline asks, for a fixed activation budget, the longest length each variant
fits by the planner's estimate (a search over lengths on fake tensors: no memory, no
compute), the unchunked graph against ``autochunk(max_memory=budget)``. The rows show how
the estimate compares with both measurements at every measured length.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from tessera.bench.harness import BenchResult

MiB = 2**20
THREADS = 2
MSA_SEQUENCES = 16
BUDGETS = (2 * 1024 * MiB, 8 * 1024 * MiB)  # the ratio grows with the budget: unchunked ~ N^3, chunked ~ N^2


class CausalGPT2Block(nn.Module):
    """A HuggingFace GPT-2 block with eager attention, fed an additive causal mask."""

    def __init__(self, small: bool):
        super().__init__()
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        size = dict(n_embd=128, n_head=4) if small else dict(n_embd=768, n_head=12)  # GPT-2 small
        self.block = GPT2Block(GPT2Config(n_layer=1, attn_implementation="eager", **size), layer_idx=0)

    def forward(self, hidden, mask):
        return self.block(hidden, attention_mask=mask)


def build(model: str, length: int, *, quick: bool, materialize: bool = True):
    """(module, example inputs). ``materialize=False`` gives inputs that take no memory
    (uninitialised, and a broadcast mask), for estimates only."""
    from tessera.models.evoformer import EvoformerBlock, EvoformerConfig

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    make = (lambda *s: torch.randn(*s, generator=g)) if materialize else torch.empty
    if model == "evoformer":
        cfg = EvoformerConfig(c_m=64, c_z=32, c_mul=32, c_opm=16) if quick else EvoformerConfig()
        s = MSA_SEQUENCES
        inputs = (make(1, s, length, cfg.c_m), make(1, length, length, cfg.c_z))
        inputs += (torch.ones(1, s, length), torch.ones(1, length, length))
        return EvoformerBlock(cfg).eval(), inputs
    if model == "gpt2":
        module = CausalGPT2Block(small=quick).eval()
        hidden = module.block.attn.embed_dim
        if materialize:
            mask = torch.full((length, length), -1e9).triu(1)[None, None]
        else:
            mask = torch.zeros(1, 1, 1, 1).expand(1, 1, length, length)
        return module, (make(1, length, hidden), mask)
    raise ValueError(f"unknown model {model!r}; known: evoformer, gpt2")


def run_case(model: str, length: int, variant: str, quick: bool, reps: int, measure: str) -> dict:
    """One measurement, in this process (the parent runs each in a fresh one): ``measure``
    "memory" (RSS and tracked peaks) or "time" (the best of ``reps`` forwards)."""
    from tessera.autochunk import autochunk, estimate_peak
    from tessera.bench.memtrack import TensorMemory, rss_peak_during

    torch.set_num_threads(THREADS)
    module, inputs = build(model, length, quick=quick)
    began = time.perf_counter()
    if variant == "autochunk":
        fn = autochunk(module, inputs)
        estimate, regions = fn.plan.estimated_peak, len(fn.plan.regions)
    else:
        fn, estimate, regions = module, estimate_peak(module, inputs), 0
    row = {"plan_seconds": time.perf_counter() - began if variant == "autochunk" else 0.0}
    with torch.no_grad():
        fn(*inputs)  # warm-up
        if measure == "memory":
            rss, out = rss_peak_during(lambda: fn(*inputs))
            del out
            with TensorMemory() as mem:
                out = fn(*inputs)
            del out
            row.update(
                rss_mib=rss / MiB, tracked_mib=mem.peak / MiB, estimate_mib=estimate / MiB, regions=regions
            )
        else:
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn(*inputs)
                times.append(time.perf_counter() - t)
            row["seconds"] = min(times)
    return row


def _fresh(case: dict) -> dict:
    """Memory in a process whose allocator returns freed blocks to the OS; time in one with
    the default allocator (what a user runs with: mmap'ing every block would tax the chunked
    variant's many smaller allocations with page faults the default allocator avoids)."""
    from tessera.bench.memtrack import fresh_process_env

    row = {k: case[k] for k in ("model", "length", "variant")}
    for measure in ("memory", "time"):
        env = (
            fresh_process_env(THREADS)
            if measure == "memory"
            else {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
        )
        done = subprocess.run(
            [sys.executable, "-m", "tessera.bench.autochunk", json.dumps({**case, "measure": measure})],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"benchmark case {case} ({measure}) failed:\n{done.stderr[-3000:]}")
        row.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return row


def longest_under_budget(model: str, chunked: bool, budget: int, *, quick: bool, step: int, hi: int) -> int:
    """The longest multiple of ``step`` up to ``hi`` whose estimated peak fits ``budget``."""
    from tessera.autochunk import BudgetError, autochunk, estimate_peak

    def fits(length: int) -> bool:
        module, inputs = build(model, length, quick=quick, materialize=False)
        if not chunked:
            return estimate_peak(module, inputs) <= budget
        try:
            autochunk(module, inputs, max_memory=budget)
        except BudgetError:
            return False
        return True

    lo, top = 0, hi // step
    while lo < top:
        mid = (lo + top + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            top = mid - 1
    return lo * step


def run_autochunk_bench(*, quick: bool, progress: bool = True) -> BenchResult:
    lengths = {
        "evoformer": [32, 64, 96] if quick else [64, 128, 256, 384, 512],
        "gpt2": [256, 512] if quick else [512, 1024, 2048, 4096],
    }
    cases = [
        dict(model=m, length=n, variant=v, quick=quick, reps=2 if n >= 384 and m == "evoformer" else 3)
        for m, ns in lengths.items()
        for n in ns
        for v in ("original", "autochunk")
    ]
    rows = []
    for case in tqdm(cases, desc="autochunk cases", disable=not progress):
        rows.append(_fresh(case))
    pairs = {}
    for row in rows:
        pairs.setdefault((row["model"], row["length"]), {})[row["variant"]] = row
    for (_, _), pair in pairs.items():
        orig, ours = pair["original"], pair["autochunk"]
        ours["rss_cut"] = 1 - ours["rss_mib"] / orig["rss_mib"]
        ours["tracked_cut"] = 1 - ours["tracked_mib"] / orig["tracked_mib"]
        ours["slowdown"] = ours["seconds"] / orig["seconds"] - 1
    headline = {}
    budgets = [BUDGETS[0] // 16] if quick else list(BUDGETS)
    search = {"evoformer": (16, 4096 if not quick else 512), "gpt2": (256, 1 << 19 if not quick else 1 << 14)}
    budget_rows = {}
    for model, ns in tqdm(list(lengths.items()), desc="budget search", disable=not progress):
        ours = pairs[(model, ns[-1])]["autochunk"]
        headline[f"{model}_rss_cut_at_{ns[-1]}"] = round(ours["rss_cut"], 3)
        headline[f"{model}_tracked_cut_at_{ns[-1]}"] = round(ours["tracked_cut"], 3)
        headline[f"{model}_slowdown_at_{ns[-1]}"] = round(ours["slowdown"], 3)
        step, hi = search[model]
        for budget in budgets:
            plain = longest_under_budget(model, False, budget, quick=quick, step=step, hi=hi)
            chunked = longest_under_budget(model, True, budget, quick=quick, step=step, hi=hi)
            budget_rows[f"{model}@{budget // MiB}MiB"] = {"unchunked": plain, "autochunk": chunked}
            headline[f"{model}_length_ratio_under_{budget // MiB}MiB"] = (
                round(chunked / plain, 2) if plain else None
            )
    notes = [
        "rss_mib: resident-set high-water mark during one forward minus the resident set before it "
        "(fresh process, MALLOC_MMAP_THRESHOLD_=65536, 2 threads); seconds: best forward in another fresh "
        "process with the default allocator; tracked_mib: peak of live "
        "tensor storages at the ATen dispatch level; estimate_mib: the planner's estimate of the traced "
        "graph (the eager original can hold more: Python locals keep some values alive).",
        f"Evoformer block: AlphaFold2 sizes (c_m 256, c_z 128), {MSA_SEQUENCES} MSA sequences, length = "
        "residues. GPT-2 block: GPT-2 small sizes (768 wide, 12 heads), eager attention with an additive "
        "causal mask, length = tokens. Quick mode shrinks both.",
        f"Longest length under a budget of activations (planner estimate, searched on fake "
        f"tensors): {budget_rows}.",
    ]
    columns = [
        "model",
        "length",
        "variant",
        "seconds",
        "rss_mib",
        "tracked_mib",
        "estimate_mib",
        "regions",
        "rss_cut",
        "tracked_cut",
        "slowdown",
    ]
    return BenchResult(
        name="autochunk",
        headline=headline,
        rows=rows,
        columns=columns,
        notes=notes,
        extra={"budgets_mib": [b // MiB for b in budgets], "longest_under_budget": budget_rows},
    )


def plot_autochunk(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in result.rows})
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        for variant, style in (("original", "o-"), ("autochunk", "s-")):
            rows = [r for r in result.rows if r["model"] == model and r["variant"] == variant]
            xs = [r["length"] for r in rows]
            axes[0][col].plot(xs, [r["rss_mib"] for r in rows], style, label=f"{variant} (RSS)")
            axes[0][col].plot(
                xs,
                [r["estimate_mib"] for r in rows],
                style[0] + ":",
                alpha=0.6,
                label=f"{variant} (estimate)",
            )
            axes[1][col].plot(xs, [r["seconds"] for r in rows], style, label=variant)
        axes[0][col].set(title=f"{model}: activation memory", xlabel="length", ylabel="MiB", yscale="log")
        axes[1][col].set(title=f"{model}: forward time", xlabel="length", ylabel="seconds", yscale="log")
        axes[0][col].legend(fontsize=8)
        axes[1][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    print(json.dumps(run_case(**json.loads(sys.argv[1]))))
