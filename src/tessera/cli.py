"""`tessera train | generate | bench | plan | serve | fdia | robust | launch`: the command line
(train, generate, bench and launch here; the others' flags beside their code).

A user's mistake (bad flag value, missing or corrupt checkpoint, unwritable output)
ends in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

EXIT_USAGE = 2


class UserError(Exception):
    """Raised by command handlers for conditions the user can fix."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# ---- train -------------------------------------------------------------------------------


def _train_rank(recipe, out_dir: str, resume: bool) -> dict:
    from tessera.runtime import Mesh
    from tessera.train.digits_dit import train

    return train(recipe, Mesh(dp=_world()), out_dir, resume=resume)


def _world() -> int:
    from tessera.runtime.mesh import world_size

    return world_size()


def cmd_train(args: argparse.Namespace) -> None:
    from tessera.runtime import spawn
    from tessera.train import checkpoint as ckpt
    from tessera.train import gpt2_text
    from tessera.train.digits_dit import RECIPE_NAME, DigitsDiTRecipe

    if args.recipe == gpt2_text.RECIPE_NAME:
        return _train_with_plan(args)
    if args.recipe == "rocbert-sentiment":
        from tessera.apps.rocbert.commands import train_command

        return print(train_command(args))
    if args.recipe != RECIPE_NAME:
        raise UserError(
            f"unknown recipe {args.recipe!r}; available: {RECIPE_NAME}, {gpt2_text.RECIPE_NAME}, rocbert-sentiment"
        )
    plan_flags = (
        args.dp,
        args.tp,
        args.zero,
        args.grad_accum,
        args.max_grad_norm,
        args.precision,
        args.activation_checkpointing,
        args.block_chunks,
        args.chunk_mib,
    )
    if plan_flags != (None, 1, 0, 1, None, "fp32", False, False, None):
        raise UserError(
            f"recipe {RECIPE_NAME} trains data parallel over --nproc only; --dp/--tp/--zero/--grad-accum/"
            f"--max-grad-norm/--precision/--activation-checkpointing/--block-chunks/--chunk-mib apply to "
            f"{gpt2_text.RECIPE_NAME}"
        )
    overrides = {
        k: v
        for k, v in (("steps", args.steps), ("seed", args.seed), ("batch_size", args.batch_size))
        if v is not None
    }
    recipe = DigitsDiTRecipe(**overrides)
    if recipe.batch_size % args.nproc:
        raise UserError(f"batch size {recipe.batch_size} is not divisible by --nproc {args.nproc}")
    out = Path(args.out)
    if args.resume:
        step = ckpt.read_train_meta(out)["step"]
        if step >= recipe.steps:
            print(f"{out} is already trained to step {step} (of {recipe.steps}); nothing to do")
            return
    elif (out / "config.json").exists():
        raise UserError(
            f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out"
        )
    began = time.perf_counter()
    if args.nproc == 1:
        summary = _train_rank(recipe, str(out), args.resume)
    else:
        summary = spawn(_train_rank, args.nproc, recipe, str(out), args.resume, timeout_s=args.timeout)[0]
    print(
        f"trained {summary['steps_run']} steps on {args.nproc} process(es) in "
        f"{time.perf_counter() - began:.1f}s (loop {summary['seconds']:.1f}s); "
        f"final loss {summary['final_loss']:.4f}; checkpoint: {out}"
    )


def _train_with_plan(args: argparse.Namespace) -> None:
    import tessera
    from tessera.bench.harness import matmul_peak_flops
    from tessera.runtime import spawn
    from tessera.train import gpt2_text

    other = args.tp * args.pp * args.sp
    if args.dp is None and args.nproc % other:
        given = [f"--{n} {getattr(args, n)}" for n in ("tp", "pp", "sp") if n == "tp" or getattr(args, n) > 1]
        product = " x ".join(given) + (f" = {other}" if len(given) > 1 else "")
        raise UserError(
            f"--nproc {args.nproc} is not a multiple of {product}: dp x pp x sp x tp must equal the processes"
        )
    dp = args.dp if args.dp is not None else args.nproc // other
    pipeline = dict(
        microbatches=args.microbatches, schedule=args.schedule, virtual_stages=args.virtual_stages
    )
    try:
        plan = tessera.Plan(
            dp=dp,
            tp=args.tp,
            pp=args.pp,
            sp=args.sp,
            sp_method=args.sp_method,
            **(pipeline if args.pp > 1 else {}),
            zero=args.zero,
            precision=args.precision,
            grad_accum=args.grad_accum,
            max_grad_norm=args.max_grad_norm,
            activation_checkpointing=args.activation_checkpointing,
            block_chunks=args.block_chunks,
            **({"chunk_mib": args.chunk_mib} if args.chunk_mib is not None else {}),
        )
        plan.check_world(args.nproc)
        overrides = {
            k: v
            for k, v in (("steps", args.steps), ("seed", args.seed), ("batch_size", args.batch_size))
            if v is not None
        }
        recipe = gpt2_text.GPT2TextRecipe(**overrides)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    split, name = (plan.num_microbatches, "microbatches") if plan.pp > 1 else (plan.grad_accum, "grad_accum")
    if recipe.batch_size % (plan.dp * split):
        raise UserError(f"batch size {recipe.batch_size} does not split into dp={plan.dp} x {name}={split}")
    out = Path(args.out)
    if not args.resume and (out / "checkpoint").exists():
        raise UserError(
            f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out"
        )
    peak = matmul_peak_flops()
    began = time.perf_counter()
    call = (recipe, plan, str(out), args.resume, peak)
    if args.nproc == 1:
        summary = gpt2_text.train_rank(*call)
    else:
        summary = spawn(gpt2_text.train_rank, args.nproc, *call, timeout_s=args.timeout)[0]
    last = summary["log"][-1] if summary["log"] else {}
    skipped = f"; {last['skipped_steps']} fp16 steps skipped" if "skipped_steps" in last else ""
    axes = f"dp={plan.dp} tp={plan.tp}" + "".join(
        f" {n}={getattr(plan, n)}" for n in ("pp", "sp") if getattr(plan, n) > 1
    )
    print(
        f"trained {summary['steps_run']} steps of {gpt2_text.RECIPE_NAME} with {axes} "
        f"zero={plan.zero} in {time.perf_counter() - began:.1f}s; final loss {summary['final_loss']}{skipped}; "
        f"{last.get('tokens_per_s', 0):.0f} tokens/s, MFU {last.get('mfu', 0):.1%}, peak RSS {last.get('peak_rss_mib', 0):.0f} MiB (rank 0); "
        f"checkpoint: {out / 'checkpoint'}, HuggingFace export: {out / 'hf'}"
    )


# ---- bench -------------------------------------------------------------------------------


# `tessera bench NAME`: the module under tessera.bench, its run and plot functions. Each
# run takes quick=...; dit and kernels take their plan (built in cmd_bench).
BENCHES = {
    name: (name, f"run_{name}_bench", f"plot_{name}")
    for name in (
        "dap",
        "train",
        "offload",
        "autochunk",
        "pipeline",
        "plan",
        "fdia",
        "serve",
        "robust",
        "machine",
        "stencil",
    )
} | {"dit": ("dit", "run_dit_bench", "plot_dit"), "kernels": ("kernels", "run_kernels_bench", "plot_kernels")}


def _dit_bench(args: argparse.Namespace):
    import dataclasses

    from tessera.bench.dit import FULL, QUICK, run_dit_bench

    digits = Path(args.digits_model)
    plan = QUICK if args.quick else FULL
    if args.link is not None:
        plan = dataclasses.replace(plan, links=tuple(n for n in args.link if n != "none"))
    if args.link_device is not None:
        plan = dataclasses.replace(plan, link_device=args.link_device)
    return run_dit_bench(plan, digits if (digits / "config.json").exists() else None)


def cmd_bench(args: argparse.Namespace) -> None:
    import importlib

    from tessera.bench.harness import write_results

    if args.name not in BENCHES:
        raise UserError(f"unknown benchmark {args.name!r}; available: {', '.join(sorted(BENCHES))}")
    module_name, run_name, plot_name = BENCHES[args.name]
    module = importlib.import_module(f"tessera.bench.{module_name}")
    if args.name == "dit":
        result = _dit_bench(args)
    elif args.name == "kernels":
        result = module.run_kernels_bench(module.QUICK if args.quick else module.FULL)
    else:
        result = getattr(module, run_name)(quick=args.quick)
    paths = write_results(result, args.out, getattr(module, plot_name))
    print("headline: " + ", ".join(f"{k}={v}" for k, v in result.headline.items()))
    print("wrote " + ", ".join(str(p) for p in paths))


# ---- launch ------------------------------------------------------------------------------


def cmd_launch(args: argparse.Namespace, extra: list[str]) -> int:
    """`tessera launch`: the whole command line after "launch" arrives in ``extra`` and is
    split by torchrun's own parser (``tessera.runtime.launch.split_launch_args``)."""
    from tessera.runtime.launch import launch_parser, split_launch_args, torchrun_command

    if not extra:
        launch_parser().print_help()
        return EXIT_USAGE
    launch = split_launch_args(extra)
    if launch.script_is_file and not Path(launch.script).is_file():
        raise UserError(f"script {launch.script} does not exist (give the path of a Python file)")
    cmd = torchrun_command(launch.nproc, launch.script, list(launch.script_args), list(launch.torchrun_flags))
    return _run_torchrun(cmd[1:])


def _run_torchrun(torchrun_args: list[str]) -> int:
    """torchrun's own entry point, in this process (torch is imported once, not again in a
    second interpreter); its workers run under this interpreter (sys.executable)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(torchrun_args)
    except ChildFailedError as exc:  # the worker's own traceback is on stderr above
        rank, failure = exc.get_first_failure()
        print(f"tessera: error: launch: rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
        return 1
    except SignalException as exc:  # torchrun ended its workers first
        print(f"tessera: launch ended by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


# ---- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a recipe with data parallel processes")
    p.add_argument("--recipe", required=True, help="recipe name (digits-dit, gpt2-text, rocbert-sentiment)")
    p.add_argument("--nproc", type=_positive_int, default=1, help="local processes (ranks)")
    p.add_argument("--out", default="runs/digits-dit", help="checkpoint folder")
    p.add_argument(
        "--steps", type=_positive_int, help="total optimizer steps (rocbert-sentiment: each stage's)"
    )
    p.add_argument("--batch-size", type=_positive_int, help="global batch size")
    p.add_argument("--seed", type=int)
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is ended")
    p.add_argument("--dp", type=_positive_int, help="data parallel degree (default: nproc / tp)")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel degree")
    p.add_argument("--pp", type=_positive_int, default=1, help="pipeline stages")
    p.add_argument("--microbatches", type=_positive_int, help="pipeline micro-batches per step (default: pp)")
    p.add_argument(
        "--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"], help="pipeline schedule"
    )
    p.add_argument("--virtual-stages", type=_positive_int, default=1, help="stages per rank (interleaved)")
    p.add_argument("--sp", type=_positive_int, default=1, help="sequence parallel degree")
    p.add_argument(
        "--sp-method", default="ring", choices=["ring", "ulysses"], help="sequence parallel attention"
    )
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over dp")
    p.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches per step")
    p.add_argument("--max-grad-norm", type=float, help="clip the global gradient norm")
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="bf16: autocast, fp32 master; fp16: the same with dynamic loss scaling",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each transformer block's activations in backward instead of keeping them",
    )
    p.add_argument("--block-chunks", action="store_true", help="a new ZeRO chunk at every transformer block")
    p.add_argument("--chunk-mib", type=float, help="ZeRO chunk size in MiB (default 32)")
    p.set_defaults(handler=cmd_train)

    from tessera.cli_generate import add_generate_parser  # flags only: models load on use

    add_generate_parser(sub, _positive_int)

    p = sub.add_parser("bench", help="run a benchmark (baseline and Tessera in one run)")
    p.add_argument("name", help="benchmark: " + ", ".join(sorted(BENCHES)))
    p.add_argument("--quick", action="store_true", help="small version, under two minutes on 2 cores")
    p.add_argument("--out", default="benchmarks/results", help="folder for NAME.json / .md / .png")
    p.add_argument(
        "--digits-model", default="runs/digits-dit", help="trained digits DiT for the fidelity table"
    )
    p.add_argument(
        "--link",
        action="append",
        help="dit: rerun the methods with transfers timed as on this link (repeatable; e.g. pcie4, nvlink4, "
        "ethernet-25g; 'none' for no link runs); default: pcie4 and ethernet-25g (quick: pcie4)",
    )
    p.add_argument(
        "--link-device", help="dit: the GPU whose compute-to-link balance the links keep (default l40)"
    )
    p.set_defaults(handler=cmd_bench)

    from tessera.serve.commands import add_serve_parser  # flags only: the server loads on use

    add_serve_parser(sub, _positive_int)

    p = sub.add_parser("plan", help="choose a parallel plan by cost model and simulation")
    plan_sub = p.add_subparsers(dest="plan_command", required=True)
    from tessera.plan.commands import add_plan_memory_parser, add_plan_parsers  # light: no model is built

    add_plan_parsers(plan_sub)  # `plan train`, `plan generate`; `plan memory` (offload) joins here
    add_plan_memory_parser(plan_sub, _positive_int)

    from tessera.cli_apps import add_app_parsers

    add_app_parsers(sub, _positive_int, cmd_bench)
    from tessera.stencil.commands import add_stencil_parser  # light: numpy only

    add_stencil_parser(sub, _positive_int)

    # No arguments here: everything after "launch" reaches cmd_launch untouched (as `extra`),
    # which parses it with torchrun's own parser (importing torch only when launching).
    p = sub.add_parser(
        "launch",
        add_help=False,
        help="run a script under torchrun: tessera launch [-n N] [torchrun flags] script.py [args]",
    )
    p.set_defaults(handler=cmd_launch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "launch":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    handler: Callable = args.handler
    try:
        result = handler(args, extra) if args.command == "launch" else handler(args)
    except (UserError, ValueError, FileNotFoundError, PermissionError) as exc:
        print(f"tessera: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        # A RankError can only come from spawn, so its module (and torch) is loaded by then.
        launch = sys.modules.get("tessera.runtime.launch")
        if launch is None or not isinstance(exc, launch.RankError):
            raise
        print(f"tessera: error: rank {exc.rank} failed: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tessera: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
