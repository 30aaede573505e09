"""`tessera train --recipe NAME`: the recipe registry and the handlers it dispatches to.

A recipe is a name with its own defaults (its output folder, runs/NAME; the Plan settings it
takes and its defaults for them) and the function that runs it. The Plan flags are generated
from ``tessera.Plan``'s fields (tessera.cli_flags); a recipe refuses by name the settings it
does not take. This module is light: recipes load their code when they run."""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tessera.apps.rocbert.commands import CLIP as ROCBERT_CLIP  # light: its code loads on use
from tessera.cli_flags import PLAN, UserError, add_fields, as_settings, flag, given

ALL_PLAN_FIELDS = tuple(f.name for f in PLAN.fields())


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str  # one line: what it trains, and how it may be spread
    run: str  # "module:function", called as function(args, plan, out) -> the line to print
    plan_fields: tuple[str, ...]  # the Plan settings it takes; the others are refused by name
    plan_defaults: Mapping[str, object] = field(default_factory=dict)  # its own, under the flags
    resumable: bool = True
    elastic: bool = False  # takes --checkpoint-dir/--checkpoint-every/--max-restarts

    @property
    def default_out(self) -> str:
        return f"runs/{self.name}"

    def handler(self):
        module, function = self.run.split(":")
        return getattr(importlib.import_module(module), function)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            name="digits-dit",
            summary="a class-conditional DiT on 8x8 digits, data parallel over --nproc",
            run="tessera.cli_train:train_digits_dit",
            plan_fields=(),
        ),
        Recipe(
            name="gpt2-text",
            summary="a small GPT-2 on bytes of text, under any Plan (dp, tp, pp, sp, ZeRO, offload, ...)",
            run="tessera.cli_train:train_gpt2_text",
            plan_fields=ALL_PLAN_FIELDS,
            elastic=True,
        ),
        Recipe(
            name="rocbert-sentiment",
            summary="ROCBERT pretraining and sentiment fine-tuning, data parallel, from scratch in minutes",
            run="tessera.apps.rocbert.commands:train_command",
            plan_fields=("dp", "zero", "grad_accum", "precision", "max_grad_norm", "chunk_mib"),
            plan_defaults={"max_grad_norm": ROCBERT_CLIP},
            resumable=False,
        ),
    )
}


def add_train_parser(sub, positive_int) -> None:
    p = sub.add_parser("train", help="train a recipe (" + ", ".join(RECIPES) + ") under a Plan")
    p.add_argument(
        "--recipe",
        required=True,
        help="; ".join(f"{r.name}: {r.summary}" for r in RECIPES.values()),
    )
    p.add_argument("--nproc", type=positive_int, default=1, help="local processes (ranks)")
    p.add_argument("--out", help="checkpoint folder (default: runs/RECIPE)")
    p.add_argument(
        "--steps", type=positive_int, help="total optimizer steps (rocbert-sentiment: each stage's)"
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        help="samples per optimizer step over all ranks (default: the recipe's)",
    )
    p.add_argument("--seed", type=int)
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is ended")
    p.add_argument(
        "--checkpoint-dir",
        help="save checkpoints here while training and resume from the newest one there by itself",
    )
    p.add_argument(
        "--checkpoint-every", type=positive_int, help="steps between checkpoints (with --checkpoint-dir)"
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="run under torchrun's elastic agent, which restarts every rank after a failure up to "
        "this many times (needs --checkpoint-dir: a restart resumes from its newest checkpoint)",
    )
    add_fields(p, PLAN, default_text={"dp": "--nproc / (tp x pp x sp)"})
    p.set_defaults(handler=cmd_train)


def cmd_train(args: argparse.Namespace) -> None:
    recipe = RECIPES.get(args.recipe)
    if recipe is None:
        raise UserError(f"unknown recipe {args.recipe!r}; available: {', '.join(RECIPES)}")
    settings = given(args, PLAN)
    _refuse_unused(recipe, settings, args.resume)
    _check_elastic(recipe, args)
    plan = _plan(recipe, settings, args.nproc)
    out = Path(args.out or recipe.default_out)
    printed = recipe.handler()(args, plan, out)
    if printed:
        print(printed)


def _refuse_unused(recipe: Recipe, settings: dict, resume: bool) -> None:
    unused = [name for name in settings if name not in recipe.plan_fields]
    refused_resume = resume and not recipe.resumable
    flags = [flag(n) for n in unused] + (["--resume"] if refused_resume else [])
    if not flags:
        return
    takers = [
        r.name
        for r in RECIPES.values()
        if r is not recipe and (any(n in r.plan_fields for n in unused) or (refused_resume and r.resumable))
    ]
    takes = ", ".join(flag(n) for n in recipe.plan_fields) or "no Plan flags"
    raise UserError(
        f"recipe {recipe.name} takes {takes}; it does not take {', '.join(flags)} (they apply to {', '.join(takers)})"
    )


def _check_elastic(recipe: Recipe, args: argparse.Namespace) -> None:
    """The checkpoint and restart flags: taken by the elastic recipes, and consistent."""
    from tessera.runtime.launch_cli import check_restarts

    flags = [
        name
        for name, value in (
            ("--checkpoint-dir", args.checkpoint_dir),
            ("--checkpoint-every", args.checkpoint_every),
            ("--max-restarts", args.max_restarts or None),
        )
        if value is not None
    ]
    if flags and not recipe.elastic:
        takers = ", ".join(r.name for r in RECIPES.values() if r.elastic)
        raise UserError(f"recipe {recipe.name} does not take {', '.join(flags)} (they apply to {takers})")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    check_restarts(args.max_restarts, args.checkpoint_dir, "--checkpoint-dir")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise UserError("--checkpoint-every needs --checkpoint-dir (where the checkpoints go)")
    if args.checkpoint_dir is not None and args.resume:
        raise UserError(
            "--checkpoint-dir resumes by itself from its newest checkpoint; drop --resume "
            "(which continues the final checkpoint in --out)"
        )


def _plan(recipe: Recipe, settings: dict, nproc: int):
    """The Plan from the flags given over the recipe's defaults; dp fills the processes the
    other degrees leave."""
    from tessera.train.plan import Plan

    values = {**recipe.plan_defaults, **settings}
    if "dp" not in values:
        other = values.get("tp", 1) * values.get("pp", 1) * values.get("sp", 1)
        if nproc % other:
            given_ = [
                f"--{n} {values.get(n, 1)}" for n in ("tp", "pp", "sp") if n == "tp" or values.get(n, 1) > 1
            ]
            product = " x ".join(given_) + (f" = {other}" if len(given_) > 1 else "")
            raise UserError(
                f"--nproc {nproc} is not a multiple of {product}: dp x pp x sp x tp must equal the processes"
            )
        values["dp"] = nproc // other
    plan = Plan(**values)
    plan.check_world(nproc)
    return plan


# ---- resume ------------------------------------------------------------------------------


def plan_text(plan) -> str:
    """A Plan in one short line: its degrees, then each setting away from the defaults."""
    rest = [w for w in as_settings(plan, PLAN).split() if not w.startswith(("dp=", "tp="))]
    return " ".join([f"dp={plan.dp}", f"tp={plan.tp}", *rest])


def saved_plan(values: dict | None):
    """The Plan a checkpoint recorded (its ``to_dict``), or None where it recorded none."""
    import dataclasses

    from tessera.train.plan import Plan

    if not values:
        return None
    known = {f.name for f in dataclasses.fields(Plan)}
    return Plan(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in known})


def resumed_line(step: int, saved, plan, checkpoint: Path) -> str:
    """``resumed from step N (plan ...; checkpoint DIR)``, and the plan it goes on under where
    that differs."""
    was = plan_text(saved) if saved is not None else "not recorded"
    line = f"resumed from step {step} (plan {was}; checkpoint {checkpoint})"
    return line if saved == plan else f"{line}, continuing under plan {plan_text(plan)}"


# ---- digits-dit --------------------------------------------------------------------------


def _digits_rank(recipe, out_dir: str, resume: bool) -> dict:
    from tessera.runtime import Mesh
    from tessera.runtime.mesh import world_size
    from tessera.train.digits_dit import train

    return train(recipe, Mesh(dp=world_size()), out_dir, resume=resume)


def _overrides(args: argparse.Namespace) -> dict:
    pairs = (("steps", args.steps), ("seed", args.seed), ("batch_size", args.batch_size))
    return {k: v for k, v in pairs if v is not None}


def train_digits_dit(args: argparse.Namespace, plan, out: Path) -> str | None:
    from tessera.runtime import spawn
    from tessera.train import checkpoint as ckpt
    from tessera.train.digits_dit import DigitsDiTRecipe

    recipe = DigitsDiTRecipe(**_overrides(args))
    if recipe.batch_size % args.nproc:
        raise UserError(f"batch size {recipe.batch_size} is not divisible by --nproc {args.nproc}")
    if args.resume:
        meta = ckpt.read_train_meta(out)
        step = meta["step"]
        if step >= recipe.steps:
            return f"{out} is already trained to step {step} (of {recipe.steps}); nothing to do"
        print(resumed_line(step, saved_plan(meta.get("plan")), plan, out), flush=True)
    elif (out / "config.json").exists():
        raise UserError(
            f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out"
        )
    began = time.perf_counter()
    if args.nproc == 1:
        summary = _digits_rank(recipe, str(out), args.resume)
    else:
        summary = spawn(_digits_rank, args.nproc, recipe, str(out), args.resume, timeout_s=args.timeout)[0]
    return (
        f"trained {summary['steps_run']} steps on {args.nproc} process(es) in "
        f"{time.perf_counter() - began:.1f}s (loop {summary['seconds']:.1f}s); "
        f"final loss {summary['final_loss']:.4f}; checkpoint: {out}"
    )


# ---- gpt2-text ---------------------------------------------------------------------------


def train_gpt2_text(args: argparse.Namespace, plan, out: Path) -> str:
    from tessera.bench.harness import matmul_peak_flops
    from tessera.runtime import spawn
    from tessera.train import gpt2_text

    recipe = gpt2_text.GPT2TextRecipe(**_overrides(args))
    split, name = (plan.microbatches, "microbatches") if plan.pp > 1 else (plan.grad_accum, "grad_accum")
    if recipe.batch_size % (plan.dp * split):
        raise UserError(f"batch size {recipe.batch_size} does not split into dp={plan.dp} x {name}={split}")
    if not args.resume and (out / "checkpoint").exists() and args.checkpoint_dir is None:
        raise UserError(
            f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out"
        )
    if args.checkpoint_dir is not None:  # refused before any rank starts, with the numbers
        from tessera.train.resume import check_directory

        params = sum(p.numel() for p in gpt2_text.build_model(recipe).parameters())
        check_directory(args.checkpoint_dir, params * 4 * 3)  # fp32 weights and AdamW's two states
    if args.resume:
        from tessera.train.checkpoint import read_config
        from tessera.train.sharded_checkpoint import FORMAT

        meta = read_config(out / "checkpoint", FORMAT)
        step = meta.get("extra", {}).get("step", 0)
        if step >= recipe.steps:
            return (
                f"{out / 'checkpoint'} is already trained to step {step} (of {recipe.steps}); nothing to do"
            )
        print(resumed_line(step, saved_plan(meta.get("plan")), plan, out / "checkpoint"), flush=True)
    peak = matmul_peak_flops()
    began = time.perf_counter()
    call = (recipe, plan, str(out), args.resume, peak, args.checkpoint_dir, args.checkpoint_every)
    if args.max_restarts:
        from tessera.runtime.launch_cli import elastic_run

        summary = elastic_run(gpt2_text.train_rank, args.nproc, *call, max_restarts=args.max_restarts)
    elif args.nproc == 1:
        summary = gpt2_text.train_rank(*call)
    else:
        summary = spawn(gpt2_text.train_rank, args.nproc, *call, timeout_s=args.timeout)[0]
    last = summary["log"][-1] if summary["log"] else {}
    skipped = f"; {last['skipped_steps']} fp16 steps skipped" if "skipped_steps" in last else ""
    axes = f"dp={plan.dp} tp={plan.tp}" + "".join(
        f" {n}={getattr(plan, n)}" for n in ("pp", "sp") if getattr(plan, n) > 1
    )
    return (
        f"trained {summary['steps_run']} steps of {gpt2_text.RECIPE_NAME} with {axes} "
        f"zero={plan.zero} in {time.perf_counter() - began:.1f}s; final loss {summary['final_loss']}{skipped}; "
        f"{last.get('tokens_per_s', 0):.0f} tokens/s, MFU {last.get('mfu', 0):.1%}, peak RSS {last.get('peak_rss_mib', 0):.0f} MiB (rank 0); "
        f"checkpoint: {out / 'checkpoint'}, HuggingFace export: {out / 'hf'}"
    )
