"""Starting ranks: `spawn()` for local multi-process runs, `init_from_env()` under torchrun.

`spawn` is what tests, benchmarks and the CLI use on one machine. The parent process owns
the rendezvous store (a TCPStore on an OS-assigned port, so concurrent runs never collide
and no port is ever guessed), watches every child, and turns the first failure into an
exception in the caller while ending the other ranks: a rank that raises can never leave
its peers blocked in a collective.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import datetime
import gc
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tessera.runtime.args import positive_int

DEFAULT_TIMEOUT_S = 300.0


class RankError(RuntimeError):
    """A rank raised (or died); carries that rank's number and formatted traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        self.rank = rank
        self.message = message
        self.remote_traceback = remote_traceback
        text = f"rank {rank} failed: {message}"
        if remote_traceback:
            text += f"\n--- traceback from rank {rank} ---\n{remote_traceback}"
        super().__init__(text)


@dataclass(frozen=True, kw_only=True)
class _RankSpec:
    rank: int
    world_size: int
    port: int
    backend: str
    threads: int
    collective_timeout_s: float


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    threads_per_rank: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    collective_timeout_s: float = 120.0,
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes joined in one process group.

    Returns the list of the ranks' return values (rank order). If any rank raises, the
    other ranks are ended and a :class:`RankError` with that rank's traceback is raised
    here; if the whole run outlasts ``timeout_s`` a ``TimeoutError`` names the ranks still
    running. ``fn`` must be importable by name (a module-level function), because ranks
    start with the ``spawn`` method: forking a process that already ran torch kernels can
    hang in the OpenMP runtime.

    After ``reuse_ranks(True)`` (the test suite's choice) the ranks of a world size are
    started once and reused by later calls (``_Pool``), unless ``fresh``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be >= 1, got {threads_per_rank}")
    backend = backend or default_backend()
    if _pooling and not fresh:
        key = _RankSpec(
            rank=-1,
            world_size=world_size,
            port=0,
            backend=backend,
            threads=threads_per_rank,
            collective_timeout_s=collective_timeout_s,
        )
        return _run_pooled(key, fn, args, timeout_s)
    # The parent hosts the store: port 0 asks the OS for a free port, held for the whole run.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = []
    for rank in range(world_size):
        spec = _RankSpec(
            rank=rank,
            world_size=world_size,
            port=store.port,
            backend=backend,
            threads=threads_per_rank,
            collective_timeout_s=collective_timeout_s,
        )
        p = ctx.Process(target=_rank_main, args=(spec, fn, args, results), daemon=True)
        p.start()
        procs.append(p)
    try:
        values = _collect(procs, results, timeout_s)
        # every rank reported: let each finish its own shutdown (one terminated there leaves
        # what it created, e.g. tqdm's process lock, to the resource tracker's leak warning)
        _join(procs, EXIT_GRACE_S)
        return values
    finally:
        _end_all(procs)
        results.close()
        results.cancel_join_thread()  # the parent never put anything; nothing to flush
        del store


def _collect(procs: list, results: mp.Queue, timeout_s: float) -> list[Any]:
    world_size = len(procs)
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            _check_dead(procs, values, {})
            if time.monotonic() > deadline:
                waiting = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(
                    f"spawn timed out after {timeout_s:.0f}s; ranks still running: {waiting}"
                ) from None
            continue
        if not ok:
            _raise_root_cause(procs, results, values, {rank: payload})
        values[rank] = pickle.loads(payload)
    return [values[r] for r in range(world_size)]


# A rank whose peer crashed fails too, with a message about the closed connection. Such
# errors are symptoms: wait briefly so the root cause can surface, then report it.
_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Timed out")


def _raise_root_cause(procs: list, results: mp.Queue, values: dict, errors: dict) -> None:
    grace = time.monotonic() + 1.0
    while time.monotonic() < grace:
        try:
            rank, ok, payload = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if not ok:
            errors.setdefault(rank, payload)
    _check_dead(procs, values, errors)
    causes = [r for r, (message, _) in errors.items() if not any(s in message for s in _SYMPTOMS)]
    rank = causes[0] if causes else next(iter(errors))
    message, tb = errors[rank]
    raise RankError(rank, message, tb)


def _check_dead(procs: list, values: dict[int, Any], errors: dict) -> None:
    """A rank that exited non-zero without reporting anything (killed, os._exit, crash)."""
    for rank, p in enumerate(procs):
        if rank not in values and rank not in errors and p.exitcode not in (None, 0):
            raise RankError(rank, f"process exited with code {p.exitcode} without a result")


EXIT_GRACE_S = 10.0


def _join(procs: list, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))


def _end_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _rank_main(spec: _RankSpec, fn: Callable[..., Any], args: tuple, results: mp.Queue) -> None:
    _rank_environment(spec)
    torch.set_num_threads(spec.threads)
    try:
        _join_group(spec)
        gc.freeze()  # what start-up made (torch's modules): the exit's collection skips it
        value = fn(*args)
        results.put((spec.rank, True, pickle.dumps(value)))
        dist.barrier()  # leave together: a peer torn down mid-collective can abort the process
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put((spec.rank, False, (f"{type(exc).__name__}: {exc}", traceback.format_exc())))
    finally:
        results.close()
        results.join_thread()  # the message is out before any teardown can kill the process
        if dist.is_initialized():
            dist.destroy_process_group()
    _quick_exit()


def _quick_exit() -> None:
    """Leave as multiprocessing's own exit does (its finalizers release the semaphores this
    rank made, e.g. tqdm's lock), without the interpreter's teardown of torch (~0.8 s a rank),
    as a forked multiprocessing child always leaves. A garbage collection first, as the
    teardown would run, so finalizers of what the rank left behind (a writer that saves on
    collection) still run."""
    import multiprocessing.util
    import sys

    gc.collect()
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- a pool of ranks reused between calls (the test suite) -------------------------------

_pooling = False


def reuse_ranks(enabled: bool) -> None:
    """Let ``spawn`` keep its ranks between calls (one pool per world size and settings), in
    this process only: the test suite's set-up turns it on; ``close_pools`` ends them."""
    global _pooling
    _pooling = enabled
    if not enabled:
        close_pools()


# each call starts torch's generator from this seed (a fresh process's is random), so what a
# call draws does not depend on what ran before it in the same rank
_CALL_SEED = 67280421310721


class _Pool:
    """``world_size`` ranks joined once and kept: each call sends every rank the function and
    its arguments (and the caller's sys.path, so a test module imports) and collects the
    results as ``spawn`` does. What a call leaves behind is undone before the next one: the
    environment, the default dtype, grad mode and thread count put back, torch's generator
    seeded alike for every call. Process groups stay: destroying them breaks DTensor's
    caches, which hold meshes by layout, and a ``Mesh`` of a layout already made reuses its
    groups (``tessera.runtime.mesh``). Groups made otherwise (torch's FSDP2, DeepSpeed) pile
    up, and each gloo group keeps threads that wake all the time: a pool whose ranks hold
    more than ``MAX_THREADS`` threads, or that served ``MAX_CALLS`` calls, is replaced. Any failure or timeout ends the pool; the next call
    starts a new one. Starting ranks (a process, torch and the test's imports, the group) is
    most of a small distributed test's time; a pool pays it once per world size."""

    def __init__(self, key: _RankSpec):
        self.store = dist.TCPStore("127.0.0.1", 0, key.world_size, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(key.world_size)]
        self.procs, self.calls = [], 0
        for rank in range(key.world_size):
            spec = dataclasses.replace(key, rank=rank, port=self.store.port)
            p = ctx.Process(target=_pool_rank_main, args=(spec, self.tasks[rank], self.results), daemon=True)
            p.start()
            self.procs.append(p)

    def run(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> list[Any]:
        self.calls += 1
        payload = pickle.dumps((fn, args))  # an unpicklable argument fails here, in the caller
        for q in self.tasks:
            q.put((list(sys.path), payload))
        return _collect(self.procs, self.results, timeout_s)

    def worn(self) -> bool:
        """Served enough calls, or a rank holds too many threads (Linux: /proc tells)."""
        if self.calls >= MAX_CALLS:
            return True
        with contextlib.suppress(OSError):
            return any(len(os.listdir(f"/proc/{p.pid}/task")) > MAX_THREADS for p in self.procs)
        return False

    def close(self) -> None:
        for q in self.tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        _join(self.procs, 5.0)
        _end_all(self.procs)
        for q in (*self.tasks, self.results):
            q.close()
            q.cancel_join_thread()


_POOLS: dict[_RankSpec, _Pool] = {}  # least recently used first
MAX_CALLS = 40
MAX_THREADS = 200
# ranks kept alive in all pools together (each holds torch and the tests' imports, ~0.5 GB):
# a new pool ends the least recently used ones beyond it
MAX_POOLED_RANKS = 10


def _run_pooled(key: _RankSpec, fn: Callable[..., Any], args: tuple, timeout_s: float) -> list[Any]:
    pool = _POOLS.pop(key, None)
    if pool is None or pool.worn() or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close()
        while _POOLS and sum(len(p.procs) for p in _POOLS.values()) + key.world_size > MAX_POOLED_RANKS:
            _POOLS.pop(next(iter(_POOLS))).close()
        pool = _Pool(key)
    _POOLS[key] = pool
    try:
        return pool.run(fn, args, timeout_s)
    except BaseException:
        _POOLS.pop(key, None)
        pool.close()
        raise


def close_pools() -> None:
    """End every pooled rank (at the end of the test session; also at interpreter exit)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(close_pools)


def _pool_rank_main(spec: _RankSpec, tasks: mp.Queue, results: mp.Queue) -> None:
    _rank_environment(spec)
    try:
        _join_group(spec)
        gc.freeze()
        while (task := tasks.get()) is not None:
            path, payload = task
            sys.path[:] = path
            environ = dict(os.environ)
            try:
                _fresh_state(spec)
                fn, args = pickle.loads(payload)
                value = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
                results.put((spec.rank, False, (f"{type(exc).__name__}: {exc}", traceback.format_exc())))
                break  # the pool ends: a peer may be waiting in a collective this rank left
            results.put((spec.rank, True, pickle.dumps(value)))
            dist.barrier()  # the next call starts together
            os.environ.clear()
            os.environ.update(environ)
    finally:
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()
    _quick_exit()


def _rank_environment(spec: _RankSpec) -> None:
    """The variables a rank's code may read, as torchrun sets them (and its thread count)."""
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    os.environ.update(
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec.port),
    )


def _join_group(spec: _RankSpec) -> None:
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank % torch.cuda.device_count())
    store = dist.TCPStore("127.0.0.1", spec.port, spec.world_size, is_master=False)
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.collective_timeout_s),
    )


def _fresh_state(spec: _RankSpec) -> None:
    """What a freshly spawned rank starts with, for the state torch keeps per process."""
    torch.set_num_threads(spec.threads)
    torch.manual_seed(_CALL_SEED)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Join the process group described by torchrun's environment variables (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK picks the GPU under NCCL). Returns
    nothing: read the world with ``torch.distributed.get_world_size()`` / ``get_rank()``, and
    build a ``Mesh`` (or let ``tessera.boost`` build the plan's) over it."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_env needs torchrun's variables; missing {missing}. "
            "Start the script with `tessera launch -n N script.py` or torchrun."
        )
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


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
