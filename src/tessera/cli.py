"""`tessera train | generate | bench | plan | serve | fdia | robust | stencil | launch`: the command line
(bench and launch here; train in cli_train, generate in cli_generate, the Plan and
ParallelConfig flags in cli_flags, the others' flags beside their code). Building the parser
imports no torch: handlers import what they use.

A user's mistake (bad flag value, missing or corrupt checkpoint, unwritable output)
ends in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from tessera.cli_flags import UserError
from tessera.cli_train import add_train_parser
from tessera.runtime.args import non_negative_int, positive_int

EXIT_USAGE = 2


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
        "moe",
        "checkpoint",
        "overlap",
    )
} | {
    "dit": ("dit", "run_dit_bench", "plot_dit"),
    "kernels": ("kernels", "run_kernels_bench", "plot_kernels"),
    "serve-generate": ("serve_generate", "run_serve_generate_bench", "plot_serve_generate"),
    "dit-video": ("dit_video", "run_dit_video_bench", "plot_dit_video"),
}


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
    for given, flag, bench, what, use in (
        (args.square_only, "--square-only", "kernels", "selects the kernels benchmark's square SGEMM rows", ""),
        (args.tvm_only, "--tvm-only", "kernels", "selects the kernels benchmark's TVM shapes", ""),
        (args.model is not None, "--model", "serve", "picks one model of the serve benchmark's full plan", " 12x768"),
    ):  # options of one benchmark's full plan
        if given and (args.name != bench or args.quick):
            raise UserError(f"{flag} {what}; got bench {args.name!r}{' with --quick' if args.quick else ''} "
                            f"(use: tessera bench {bench} {flag}{use})")
    module_name, run_name, plot_name = BENCHES[args.name]
    module = importlib.import_module(f"tessera.bench.{module_name}")
    if args.name == "dit":
        result = _dit_bench(args)
    elif args.name == "kernels":
        import dataclasses

        plan = (module.SQUARE if args.square_only else module.TVM if args.tvm_only else module.QUICK if args.quick
                else module.FULL)
        if args.tvm_trials == 0:  # TVM left out: the rest of the run in minutes
            plan = dataclasses.replace(plan, tvm_gemms=(), tvm_convs=())
        elif args.tvm_trials is not None:
            plan = dataclasses.replace(plan, tvm_trials=args.tvm_trials)
        result = module.run_kernels_bench(plan)
        if args.square_only or args.tvm_only:  # beside the full run's files, not over them
            result = dataclasses.replace(result, name="kernels-sgemm" if args.square_only else "kernels-tvm")
    elif args.name == "serve" and args.model is not None:
        try:
            result = module.run_serve_bench(only=args.model)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    else:
        result = getattr(module, run_name)(quick=args.quick)
    paths = write_results(result, args.out, getattr(module, plot_name))
    print("headline: " + ", ".join(f"{k}={v}" for k, v in result.headline.items()))
    print("wrote " + ", ".join(str(p) for p in paths))


# ---- launch ------------------------------------------------------------------------------


def cmd_launch(args: argparse.Namespace, extra: list[str]) -> int:
    """`tessera launch`: the whole command line after "launch" arrives in ``extra`` and is
    split by torchrun's own parser (``tessera.runtime.launch_cli.split_launch_args``)."""
    from tessera.runtime.launch_cli import launch_parser, split_launch_args, torchrun_command

    if not extra:
        launch_parser().print_help()
        return EXIT_USAGE
    launch = split_launch_args(extra)
    if launch.script_is_file and not Path(launch.script).is_file():
        raise UserError(f"script {launch.script} does not exist (give the path of a Python file)")
    cmd = torchrun_command(launch.nproc, launch.script, list(launch.script_args), list(launch.torchrun_flags))
    os.environ.update(launch.worker_env())  # --checkpoint-dir/--checkpoint-every, for the workers
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

    add_train_parser(sub, positive_int)  # the recipe registry; recipes load on use

    from tessera.cli_generate import add_generate_parser  # flags only: models load on use

    add_generate_parser(sub, positive_int)

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
    p.add_argument(
        "--tvm-trials",
        type=non_negative_int,
        help="kernels: TVM MetaSchedule's measured trials per shape (default 1000, what TVM's CPU tuning "
        "tutorial recommends; the speed-versus-trials curve is recorded either way; 0: TVM not run)",
    )
    p.add_argument(
        "--square-only",
        action="store_true",
        help="kernels: only the square SGEMM rows (256^3-4096^3, 1 and 2 threads) with their fraction of the FMA "
        "peak probed in each timing round; written as kernels-sgemm.* beside the full run's files",
    )
    p.add_argument(
        "--tvm-only",
        action="store_true",
        help="kernels: only the shapes TVM tunes (a square GEMM, a BERT MLP GEMM, a 3x3 convolution; 1 thread), "
        "every anchor beside them; written as kernels-tvm.* beside the full run's files",
    )
    p.add_argument(
        "--model",
        help="serve: one model of the full plan (6x384 or 12x768), run as in the whole plan; written as "
        "serve-<model>.* beside the full run's files",
    )
    p.set_defaults(handler=cmd_bench)

    from tessera.serve.commands import add_serve_parser  # flags only: the server loads on use

    add_serve_parser(sub, positive_int)

    p = sub.add_parser("plan", help="choose a parallel plan by cost model and simulation")
    plan_sub = p.add_subparsers(dest="plan_command", required=True)
    from tessera.plan.commands import add_plan_memory_parser, add_plan_parsers  # light: no model is built

    add_plan_parsers(plan_sub)  # `plan train`, `plan generate`; `plan memory` (offload) joins here
    add_plan_memory_parser(plan_sub, positive_int)

    from tessera.cli_apps import add_app_parsers

    add_app_parsers(sub, positive_int, cmd_bench)
    from tessera.stencil.commands import add_stencil_parser  # light: no numpy until it runs

    add_stencil_parser(sub, positive_int)

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
    with warnings.catch_warnings(record=True) as renamed:  # old flag names, shown as one line each
        warnings.simplefilter("always", FutureWarning)
        args, extra = parser.parse_known_args(argv)
    for w in renamed:
        print(f"tessera: warning: {w.message}", file=sys.stderr)
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
