"""`tessera launch` and `tessera train --max-restarts`: torchrun's own flags, in every form
torchrun accepts, split where the script starts; the torchrun command they become; and
torchrun's elastic agent around a Python function. Ranks start through torchrun here;
``tessera.runtime.launch`` starts local ranks itself (``spawn``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tessera.runtime.args import positive_int
from tessera.runtime.launch import RankError, init_from_env

# ---- `tessera launch`: torchrun's own flags, in every form torchrun accepts ----------------

LAUNCH_USAGE = "tessera launch [-n N] [--checkpoint-dir DIR [--checkpoint-every STEPS]] [torchrun flags] script.py [script args]"

# `tessera launch --checkpoint-dir/--checkpoint-every` reach the workers as these variables;
# ``tessera.train.resume_or_start`` reads them when its caller names no directory.
CHECKPOINT_DIR_ENV, CHECKPOINT_EVERY_ENV = "TESSERA_CHECKPOINT_DIR", "TESSERA_CHECKPOINT_EVERY"

# Flags that describe where the rendezvous is. With none of them (on the command line or as
# torchrun's PET_* variables) `tessera launch` adds --standalone: a local rendezvous on a free
# port, so no port is ever guessed.
_RENDEZVOUS_DESTS = (
    "nnodes",
    "node_rank",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "master_addr",
    "master_port",
    "standalone",
)


@dataclass(frozen=True, kw_only=True)
class LaunchArgs:
    """A `tessera launch` command line split where the script starts."""

    nproc: int | None  # tessera's -n/--nproc (None: torchrun's --nproc-per-node or its default)
    torchrun_flags: tuple[str, ...]  # the flags before the script as given, less Tessera's own
    script: str
    script_args: tuple[str, ...]
    script_is_file: bool  # False under torchrun's -m/--module or --no-python
    checkpoint_dir: str | None = None  # where the workers resume from (TESSERA_CHECKPOINT_DIR)
    checkpoint_every: int | None = None  # TESSERA_CHECKPOINT_EVERY
    max_restarts: int = 0  # torchrun's, as given

    def worker_env(self) -> dict[str, str]:
        """The variables torchrun and its workers get: the checkpoint settings and, with
        restarts, a rendezvous store apart from the one training's groups use. torchrun's agent
        shares its store with the workers by default, and a restarted group then reads the
        addresses its dead predecessors published (any group beyond the default one, e.g. the
        checkpoint writer's) and fails to connect (pytorch/pytorch#135712)."""
        env = {}
        if self.max_restarts:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get(
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"
            )
        if self.checkpoint_dir is not None:
            env[CHECKPOINT_DIR_ENV] = str(self.checkpoint_dir)
        if self.checkpoint_every is not None:
            env[CHECKPOINT_EVERY_ENV] = str(self.checkpoint_every)
        return env


class _LaunchParser(argparse.ArgumentParser):
    """argparse's errors as ValueError (one line, printed by the CLI), not usage + exit."""

    def error(self, message: str):  # type: ignore[override]
        if "required: training_script" in message:  # torchrun's positionals, by their dest names
            message = "no script given"
        raise ValueError(f"launch: {message}; usage: {LAUNCH_USAGE}")


def torchrun_parser(prog: str = "torchrun") -> argparse.ArgumentParser:
    """torchrun's own parser (``torch.distributed.run.get_args_parser``: every flag it knows,
    with its arity), raising ValueError; a rendezvous flag or --nproc-per-node not given
    parses as None, so that "given" can be told from torchrun's default."""
    from torch.distributed.run import get_args_parser

    parser = _LaunchParser(
        prog=prog,
        parents=[get_args_parser()],
        add_help=False,  # the parent's -h/--help comes along
        description="Run a script under torchrun; every torchrun flag is accepted, "
        "as `--flag value` or `--flag=value`.",
    )
    parser.set_defaults(**{dest: None for dest in (*_RENDEZVOUS_DESTS, "nproc_per_node")})
    return parser


def launch_parser() -> argparse.ArgumentParser:
    """The parser of `tessera launch`: torchrun's flags plus ``-n/--nproc``."""
    parser = torchrun_parser("tessera launch")
    parser.add_argument(
        "-n", "--nproc", type=positive_int, help="processes per node (the same as --nproc-per-node)"
    )
    parser.add_argument(
        "--checkpoint-dir",
        help="checkpoints of the run (required with --max-restarts: a restart resumes from the newest); "
        "the script reads it through tessera.train.resume_or_start",
    )
    parser.add_argument(
        "--checkpoint-every", type=positive_int, help="steps between checkpoints (resume_or_start's every)"
    )
    return parser


def _parse(parser: argparse.ArgumentParser, tokens: list[str]) -> tuple[argparse.Namespace, int]:
    """Parse as torchrun does; returns the namespace and the index of the script in ``tokens``."""
    ns, unknown = parser.parse_known_args(tokens)
    if unknown:
        raise ValueError(
            f"launch: unknown flag(s) before the script: {' '.join(unknown)}; "
            f"`tessera launch --help` lists torchrun's flags"
        )
    # torchrun's last positional takes everything after the script (REMAINDER), less a "--"
    # right after the script, which argparse gives the script's positional and drops
    index = len(tokens) - len(ns.training_script_args) - 1
    while index > 0 and tokens[index] == "--":
        index -= 1
    if tokens[index] != ns.training_script:
        raise ValueError(
            f"launch: cannot tell where the script starts in {' '.join(tokens)}; usage: {LAUNCH_USAGE}"
        )
    return ns, index


_OWN_FLAGS = ("-n", "--nproc", "--checkpoint-dir", "--checkpoint-every")


def _without_nproc(flags: list[str]) -> list[str]:
    """``flags`` less tessera's own (-n/--nproc, --checkpoint-dir, --checkpoint-every) and
    their values. Exact, since argparse never takes a token that starts with "-" as an
    option's value: a "-n..." token is always the option."""
    kept: list[str] = []
    i = 0
    while i < len(flags):
        token = flags[i]
        if token in _OWN_FLAGS:
            i += 2
            continue
        joined = token.startswith(tuple(f"{f}=" for f in _OWN_FLAGS[1:]))
        if not (joined or (token.startswith("-n") and not token.startswith("--"))):
            kept.append(token)  # "-n4", "-n=4", "--nproc=4", "--checkpoint-dir=d" are dropped whole
        i += 1
    return kept


def split_launch_args(argv: list[str]) -> LaunchArgs:
    """Split a `tessera launch` command line where the script starts, knowing every torchrun
    flag's arity (``--nnodes 2`` and ``--nnodes=2`` alike); ValueError on a mistake."""
    tokens = list(argv)
    ns, index = _parse(launch_parser(), tokens)
    _check_one_nproc(ns.nproc, ns.nproc_per_node)
    check_restarts(ns.max_restarts, ns.checkpoint_dir, "--checkpoint-dir")
    if ns.checkpoint_every is not None and ns.checkpoint_dir is None:
        raise ValueError("launch: --checkpoint-every needs --checkpoint-dir (where the checkpoints go)")
    return LaunchArgs(
        nproc=ns.nproc,
        torchrun_flags=tuple(_without_nproc(tokens[:index])),
        script=ns.training_script,
        script_args=tuple(ns.training_script_args),
        script_is_file=not (ns.module or ns.no_python),
        checkpoint_dir=ns.checkpoint_dir,
        checkpoint_every=ns.checkpoint_every,
        max_restarts=ns.max_restarts or 0,
    )


def check_restarts(max_restarts: int | None, checkpoint_dir, flag: str) -> None:
    """Restarts without checkpoints would start the job over: refused in one line."""
    if max_restarts and checkpoint_dir is None:
        raise ValueError(
            f"--max-restarts {max_restarts} needs {flag}: a restarted job resumes from its newest "
            "checkpoint, and without one it would start over"
        )


def _check_one_nproc(nproc: int | None, nproc_per_node: str | None) -> None:
    if nproc is not None and nproc_per_node is not None:
        raise ValueError(
            f"launch: -n {nproc} and --nproc-per-node {nproc_per_node} both set the processes per node; "
            "give one of them"
        )


def _rendezvous_given(ns: argparse.Namespace) -> bool:
    return any(
        getattr(ns, dest) not in (None, False) or os.environ.get(f"PET_{dest.upper()}")
        for dest in _RENDEZVOUS_DESTS
    )


def torchrun_command(nproc: int | None, script: str, script_args: list[str], extra: list[str]) -> list[str]:
    """The torchrun command line that `tessera launch` runs (it reads only torchrun's PET_*
    variables, so it is testable). ``extra`` holds torchrun flags in any form torchrun accepts; unless they (or torchrun's
    PET_* variables) describe a rendezvous, --standalone is added."""
    if nproc is not None and nproc < 1:
        raise ValueError(f"-n/--nproc must be >= 1, got {nproc}")
    ns, _ = _parse(torchrun_parser(), [*extra, script])
    _check_one_nproc(nproc, ns.nproc_per_node)
    cmd = ["torchrun"]
    if nproc is not None:
        cmd.append(f"--nproc-per-node={nproc}")
    if not _rendezvous_given(ns):
        cmd.append("--standalone")  # before the user's flags: a "--" among them ends the options
    return [*cmd, *extra, script, *script_args]


# ---- torchrun's elastic agent for a Python function (`tessera train --max-restarts`) -------


def elastic_run(fn: Callable[..., Any], nproc: int, *args: Any, max_restarts: int) -> Any:
    """Run ``fn(*args)`` in ``nproc`` local ranks under torchrun's elastic agent (its Python
    entry, ``torch.distributed.launcher.api.elastic_launch``, as ``torchrun --standalone``
    sets it up): a rank that dies or raises ends its peers, and the agent starts them all
    again, up to ``max_restarts`` times; ``fn`` resumes by itself (from its checkpoints).
    Returns rank 0's value; a failure after the last restart is a RankError."""
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.update(
        LaunchArgs(
            nproc=nproc,
            torchrun_flags=(),
            script="",
            script_args=(),
            script_is_file=False,
            max_restarts=max_restarts,
        ).worker_env()
    )
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone
        max_restarts=max_restarts,
        start_method="spawn",
    )
    try:
        values = elastic_launch(config, _elastic_rank)(fn, args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise RankError(
            rank, f"exited with code {failure.exitcode} after {max_restarts} restart(s)"
        ) from None
    return values[0]


def _elastic_rank(fn: Callable[..., Any], args: tuple) -> Any:
    init_from_env()
    try:
        value = fn(*args)
        dist.barrier()  # leave together: a peer torn down mid-collective can abort the process
        return value
    finally:
        dist.destroy_process_group()
