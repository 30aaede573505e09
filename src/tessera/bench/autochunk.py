"""`tessera bench autochunk`: the original module against ``tessera.autochunk`` of it.

Models (each chunked module is compared with its own original):

- ``evoformer``: the AlphaFold2 Evoformer block (c_m 256, c_z 128), 16 MSA sequences;
  length = residues.
- ``gpt2``: a HuggingFace GPT-2 block (GPT-2 small: 768 wide, 12 heads) with SDPA attention
  and ``is_causal`` (no mask tensor, no N² scores): the fair baseline.
- ``gpt2-eager``: the same block with eager attention and an additive causal mask built in
  the forward (as ``GPT2Model`` builds one): the mask and the scores are N².

Sweep. Each (model, length, variant) is measured in two fresh Python processes (2 threads
each): memory with ``MALLOC_MMAP_THRESHOLD_`` set so freed blocks go back to the OS, time
with the default allocator. After one warm-up forward:

- ``rss_mib``: activation memory as the OS sees it: the resident-set high-water mark
  (``VmHWM``, reset through ``/proc/self/clear_refs``) during one forward, minus the
  resident set before it (inputs and weights already there). Allocator and kernel scratch
  included.
- ``tracked_mib``: the peak of live tensor storages the forward allocates, tracked at the
  ATen dispatch level (``tessera.memory.track.TensorMemory``; blind to kernel-internal copies).
- ``estimate_mib``: the planner's estimate (of the traced graph, unchunked or chunked).
- ``seconds``: the best of a few timed forwards (no_grad), in a second fresh process.

Budgets. Three variants: the original (eager) module, its traced graph run unchunked
("graph": the same ops, but each value freed after its last use, which eager Python does not
always do), and autochunk. For each budget the planner proposes the longest length that
fits, searched on fake tensors (no memory, no compute): for the unchunked two by the graph's
estimate, for autochunk by ``autochunk(max_memory=budget)`` succeeding. Then the module is
run at that length in a fresh process (memory measurement as above, after a warm-up forward
at a short length) and its measured peak compared with the budget. The planner is given the
budget less ``reserve(budget)`` (4 MiB and 0.25%: for what its estimate leaves out,
kernels' work buffers). A run over the budget is followed by a re-plan with the planning
budget lowered by 1.5 times the overshoot (and at least one length step shorter) until a
run fits, and an unchunked variant is then run once more halfway between the two; every
attempt is a row.
Budgets not in ``run_budgets`` are planned only (their rows say ``run: false``).
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
MODELS = ("evoformer", "gpt2", "gpt2-eager")
BUDGETS = (2 * 1024 * MiB, 8 * 1024 * MiB)  # unchunked Evoformer memory grows ~N^3, chunked ~N^2
QUICK_BUDGET = 32 * MiB
MAX_ATTEMPTS = 4  # budget runs per (model, budget, variant) before giving up
# Planned for the budget less a reserve for what the estimate leaves out (kernels' work
# buffers, ~0.5 MiB a thread for flash attention; allocator rounding): measured 1.3-1.5 MiB
# at 2 threads on the quick models, 3.2 MiB on the Evoformer at 1424 residues under 2 GiB.


def reserve(budget: int) -> int:
    return 4 * MiB + budget // 400


SEARCH = {  # length step and ceiling of the budget search
    "evoformer": (16, 4096),
    "gpt2": (256, 1 << 20),
    "gpt2-eager": (256, 1 << 17),
}
WARMUP_LENGTH = {"evoformer": 32, "gpt2": 256, "gpt2-eager": 256}


class GPT2BlockModule(nn.Module):
    """A HuggingFace GPT-2 block. ``sdpa``: causal by ``is_causal``, no mask. ``eager``:
    eager attention with an additive causal mask built here, an (N, N) activation."""

    def __init__(self, small: bool, attention: str):
        super().__init__()
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        size = dict(n_embd=128, n_head=4) if small else dict(n_embd=768, n_head=12)  # GPT-2 small
        config = GPT2Config(n_layer=1, attn_implementation=attention, **size)
        self.attention = attention
        self.block = GPT2Block(config, layer_idx=0)

    def forward(self, hidden):
        if self.attention == "sdpa":
            return self.block(hidden)
        n = hidden.shape[1]
        mask = torch.full((n, n), -1e9, dtype=hidden.dtype, device=hidden.device).triu_(1)
        return self.block(hidden, attention_mask=mask[None, None])


def build(model: str, length: int, *, quick: bool, materialize: bool = True):
    """(module, example inputs). ``materialize=False`` gives inputs that take no memory
    (uninitialised), for estimates only."""
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
    if model in ("gpt2", "gpt2-eager"):
        module = GPT2BlockModule(small=quick, attention="sdpa" if model == "gpt2" else "eager").eval()
        return module, (make(1, length, module.block.attn.embed_dim),)
    raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")


def _variant(model: str, length: int, variant: str, quick: bool, budget: int | None):
    """(callable, estimated peak, regions, inputs) for one variant at one length: "original"
    (the eager module), "autochunk", or "graph" (its traced graph run unchunked, the graph
    the unchunked estimate describes)."""
    from tessera.autochunk import autochunk, estimate_peak

    module, inputs = build(model, length, quick=quick)
    if variant in ("autochunk", "graph"):
        fn = autochunk(module, inputs, max_memory=budget if variant == "autochunk" else 1 << 60)
        return fn, fn.plan.estimated_peak, len(fn.plan.regions), inputs
    return module, estimate_peak(module, inputs), 0, inputs


def run_case(
    model: str, length: int, variant: str, quick: bool, measure: str, reps: int = 1, budget: int | None = None
) -> dict:
    """One measurement, in this process (the parent runs each in a fresh one). ``measure``:
    "memory" (RSS and tracked peaks), "time" (the best of ``reps`` forwards), or "budget"
    (one forward's RSS peak, planned with ``max_memory=budget``, after a warm-up forward at a
    short length so one-time library set-up is not counted)."""
    from tessera.memory.track import TensorMemory, rss_peak_during

    torch.set_num_threads(THREADS)
    if measure == "budget":
        warm, _, _, warm_inputs = _variant(model, WARMUP_LENGTH[model], variant, quick, None)
        with torch.no_grad():
            warm(*warm_inputs)
        del warm, warm_inputs
    began = time.perf_counter()
    fn, estimate, regions, inputs = _variant(model, length, variant, quick, budget)
    row = {"plan_seconds": time.perf_counter() - began if variant == "autochunk" else 0.0}
    row.update(estimate_mib=estimate / MiB, regions=regions)
    with torch.no_grad():
        if measure == "budget":
            began = time.perf_counter()
            rss, out = rss_peak_during(lambda: fn(*inputs))
            del out
            return row | {"rss_mib": rss / MiB, "seconds": time.perf_counter() - began}
        fn(*inputs)  # warm-up
        if measure == "memory":
            rss, out = rss_peak_during(lambda: fn(*inputs))
            del out
            with TensorMemory() as mem:
                out = fn(*inputs)
            del out
            return row | {"rss_mib": rss / MiB, "tracked_mib": mem.peak / MiB}
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(*inputs)
            times.append(time.perf_counter() - t)
        return row | {"seconds": min(times)}


def fresh_run(case: dict) -> dict:
    """``run_case(**case)`` in a fresh process: one whose allocator returns freed blocks to
    the OS for memory, the default allocator for time (what a user runs with: mmap'ing every
    block would tax the chunked variant's many smaller allocations with page faults)."""
    from tessera.memory.track import fresh_process_env

    if case["measure"] == "time":
        env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    else:
        env = fresh_process_env(THREADS)
    done = subprocess.run(
        [sys.executable, "-m", "tessera.bench.autochunk", json.dumps(case)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"benchmark case {case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _sweep_row(model: str, length: int, variant: str, quick: bool) -> dict:
    reps = 2 if model == "evoformer" and length >= 384 else 3
    row = {"part": "sweep", "model": model, "length": length, "variant": variant}
    for measure in ("memory", "time"):
        row.update(
            fresh_run(
                dict(model=model, length=length, variant=variant, quick=quick, measure=measure, reps=reps)
            )
        )
    return row


def longest_under_budget(model: str, chunked: bool, budget: int, *, quick: bool, step: int, hi: int) -> int:
    """The longest multiple of ``step`` up to ``hi`` whose estimated peak fits ``budget`` (0 if none)."""
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


def _planned_estimate(model: str, length: int, variant: str, quick: bool, budget: int) -> float:
    from tessera.autochunk import autochunk, estimate_peak

    module, inputs = build(model, length, quick=quick, materialize=False)
    if variant == "autochunk":
        return autochunk(module, inputs, max_memory=budget).plan.estimated_peak / MiB
    return estimate_peak(module, inputs) / MiB


def _budget_run(model: str, length: int, variant: str, quick: bool, budget: int, planning: int) -> dict:
    case = dict(model=model, length=length, variant=variant, quick=quick, measure="budget")
    row = fresh_run(case | {"budget": planning if variant == "autochunk" else None})
    return row | {"fits": row["rss_mib"] <= budget / MiB}


def budget_rows(model: str, budget: int, variant: str, *, quick: bool, run: bool, report=print) -> list[dict]:
    """The planner's longest length under ``budget``, run and measured (see the module
    docstring); one row per attempt. After a run over the budget and one that fits, an
    unchunked variant (whose run does not depend on the plan) is run once more halfway
    between the two, so its length is not left short by the back-off."""
    step, hi = SEARCH[model]
    if quick:
        hi = min(hi, 512 if model == "evoformer" else 1 << 15)
    planning, rows, over = budget - reserve(budget), [], None
    for attempt in range(1, MAX_ATTEMPTS + 1):
        length = longest_under_budget(model, variant == "autochunk", planning, quick=quick, step=step, hi=hi)
        row = dict(part="budget", model=model, variant=variant, budget_mib=budget / MiB, attempt=attempt)
        row.update(planning_budget_mib=planning / MiB, length=length, run=run and length > 0)
        if not row["run"]:
            if length:
                row["estimate_mib"] = _planned_estimate(model, length, variant, quick, planning)
            rows.append(row)
            report(row)
            break
        row.update(_budget_run(model, length, variant, quick, budget, planning))
        rows.append(row)
        report(row)
        if row["fits"]:
            middle = (length + over) // 2 // step * step if over else length
            if variant != "autochunk" and middle > length:
                row = rows[-1] | {"attempt": attempt + 1, "length": middle, "planning_budget_mib": None}
                row.update(_budget_run(model, middle, variant, quick, budget, planning))
                rows.append(row)
                report(row)
            break
        planning -= int(1.5 * (row["rss_mib"] * MiB - budget))  # the overshoot, and half again
        over, hi = length, length - step
    return rows


def _sweep_headline(rows: list[dict], headline: dict) -> None:
    pairs: dict = {}
    for row in rows:
        pairs.setdefault((row["model"], row["length"]), {})[row["variant"]] = row
    for pair in pairs.values():
        orig, ours = pair["original"], pair["autochunk"]
        ours["rss_cut"] = 1 - ours["rss_mib"] / orig["rss_mib"]
        ours["tracked_cut"] = 1 - ours["tracked_mib"] / orig["tracked_mib"]
        ours["slowdown"] = ours["seconds"] / orig["seconds"] - 1
        for row in (orig, ours):
            row["estimate_over_rss"] = row["estimate_mib"] / row["rss_mib"]
    for model in dict.fromkeys(r["model"] for r in rows):
        lengths = sorted(n for m, n in pairs if m == model)
        for n in dict.fromkeys((lengths[0], lengths[-1])):
            ours, orig = pairs[(model, n)]["autochunk"], pairs[(model, n)]["original"]
            headline[f"{model}_rss_cut_at_{n}"] = round(ours["rss_cut"], 3)
            headline[f"{model}_slowdown_at_{n}"] = round(ours["slowdown"], 3)
            headline[f"{model}_seconds_at_{n}"] = {
                "original": round(orig["seconds"], 3),
                "autochunk": round(ours["seconds"], 3),
            }
        ours = pairs[(model, lengths[-1])]["autochunk"]
        headline[f"{model}_chunked_estimate_over_rss_at_{lengths[-1]}"] = round(ours["estimate_over_rss"], 3)


def _budget_headline(rows: list[dict], headline: dict) -> dict:
    """Per (model, budget): the planned and the longest measured-fitting length of each variant."""
    summary: dict = {}
    for row in rows:
        entry = summary.setdefault(f"{row['model']}@{int(row['budget_mib'])}MiB", {})
        side = entry.setdefault(row["variant"], {"planned": row["length"], "fits": None})
        if row.get("fits") and row["length"] > (side["fits"] or 0):  # the longest run that fit
            side["fits"] = row["length"]
            side["rss_mib"] = round(row["rss_mib"], 1)
    for key, entry in summary.items():
        model, budget = key.split("@")
        ours = entry.get("autochunk", {})
        for base, name in (("original", "length_ratio"), ("graph", "length_ratio_to_graph")):
            other = entry.get(base, {})
            if other.get("fits") and ours.get("fits"):
                headline[f"{model}_measured_{name}_under_{budget}"] = round(ours["fits"] / other["fits"], 2)
            elif other.get("planned") and ours.get("planned"):
                ratio = round(ours["planned"] / other["planned"], 2)
                headline[f"{model}_planned_{name}_under_{budget}"] = ratio
    return summary


COLUMNS = [
    "part", "model", "length", "variant", "budget_mib", "attempt", "planning_budget_mib", "run", "fits",
    "seconds", "rss_mib", "tracked_mib", "estimate_mib", "estimate_over_rss", "regions", "rss_cut",
    "tracked_cut", "slowdown",
]  # fmt: skip


def run_autochunk_bench(
    *,
    quick: bool,
    progress: bool = True,
    run_budgets: tuple[int, ...] | None = None,
    models: tuple[str, ...] = MODELS,
) -> BenchResult:
    """The sweep and the budget runs. ``run_budgets`` (bytes): the budgets whose lengths are
    run, the others planned only; default the smallest budget. ``models``: a subset of
    MODELS (the test suite runs one, to stay within its time)."""
    unknown = set(models) - set(MODELS)
    if unknown:
        raise ValueError(f"unknown autochunk bench models {sorted(unknown)}; choose from {MODELS}")
    lengths = {
        "evoformer": [96] if quick else [64, 128, 256, 512],
        "gpt2": [4096] if quick else [1024, 4096, 16384],
        "gpt2-eager": [512] if quick else [1024, 2048, 4096],
    }
    budgets = [QUICK_BUDGET] if quick else list(BUDGETS)
    run_budgets = tuple(budgets[:1]) if run_budgets is None else tuple(run_budgets)
    report = (lambda row: tqdm.write(json.dumps(row))) if progress else (lambda row: None)
    cases = [
        (m, n, v) for m, ns in lengths.items() if m in models for n in ns for v in ("original", "autochunk")
    ]
    sweep = []
    for model, n, variant in tqdm(cases, desc="autochunk sweep", disable=not progress):
        sweep.append(_sweep_row(model, n, variant, quick))
        report(sweep[-1])
    headline: dict = {}
    _sweep_headline(sweep, headline)
    budget = []
    jobs = [(m, b, v) for b in budgets for m in models for v in ("original", "graph", "autochunk")]
    for model, b, variant in tqdm(jobs, desc="autochunk budgets", disable=not progress):
        budget += budget_rows(model, b, variant, quick=quick, run=b in run_budgets, report=report)
    summary = _budget_headline(budget, headline)
    notes = [
        "rss_mib: resident-set high-water mark during one forward minus the resident set before it "
        f"(fresh process, MALLOC_MMAP_THRESHOLD_=65536, {THREADS} threads); seconds: best forward in another "
        "fresh process with the default allocator (budget rows: the one measured forward); tracked_mib: "
        "peak of live tensor storages at the ATen dispatch level (blind to copies kernels make inside "
        "themselves); estimate_mib: the planner's estimate of the traced graph (the eager original can "
        "hold more: Python locals keep some values alive).",
        f"evoformer: AlphaFold2 Evoformer block (c_m 256, c_z 128), {MSA_SEQUENCES} MSA sequences, length = "
        "residues. gpt2: GPT-2 small block (768 wide, 12 heads), SDPA with is_causal (no mask tensor). "
        "gpt2-eager: the same block with eager attention and an additive causal mask built in the forward. "
        "Quick mode shrinks all three.",
        "Budget rows: the planner's longest length under the budget less 4 MiB and 0.25% "
        "(original, the eager module, and graph, its traced graph run unchunked: the graph's estimate; "
        "autochunk: autochunk(max_memory=...) succeeds), then one forward "
        "at it in a fresh process (after a warm-up at a short length); a run over the budget is re-planned "
        "with planning_budget lowered by 1.5x the overshoot, one length step shorter at least (the original "
        "is then run once more halfway between the lengths that fit and did not). run=false: "
        f"planned only (budgets run: {[b // MiB for b in run_budgets]} MiB). Summary: {summary}.",
    ]
    return BenchResult(
        name="autochunk",
        headline=headline,
        rows=sweep + budget,
        columns=COLUMNS,
        notes=notes,
        extra={"budgets_mib": [b // MiB for b in budgets], "under_budget": summary},
    )


def plot_autochunk(result: BenchResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in result.rows if r.get("part") == "sweep"]
    models = list(dict.fromkeys(r["model"] for r in sweep))
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        for variant, style in (("original", "o-"), ("autochunk", "s-")):
            rows = [r for r in sweep if r["model"] == model and r["variant"] == variant]
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
