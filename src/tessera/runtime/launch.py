"""Starting ranks: `spawn()` for local multi-process runs, `init_from_env()` under torchrun.

`spawn` is what tests, benchmarks and the CLI use on one machine. The parent process owns
the rendezvous store (a TCPStore on an OS-assigned port, so concurrent runs never collide
and no port is ever guessed), watches every child, and turns the first failure into an
exception in the caller while ending the other ranks: a rank that raises can never leave
its peers blocked in a collective.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

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
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes joined in one process group.

    Returns the list of the ranks' return values (rank order). If any rank raises, the
    other ranks are ended and a :class:`RankError` with that rank's traceback is raised
    here; if the whole run outlasts ``timeout_s`` a ``TimeoutError`` names the ranks still
    running. ``fn`` must be importable by name (a module-level function), because ranks
    start with the ``spawn`` method: forking a process that already ran torch kernels can
    hang in the OpenMP runtime.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be >= 1, got {threads_per_rank}")
    backend = backend or default_backend()
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
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    torch.set_num_threads(spec.threads)
    os.environ.update(
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec.port),
    )
    try:
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


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Join the process group described by torchrun's environment variables."""
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


def torchrun_command(nproc: int, script: str, script_args: list[str], extra: list[str]) -> list[str]:
    """The torchrun command line that `tessera launch` runs (kept pure so it is testable)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    cmd = ["torchrun", f"--nproc-per-node={nproc}", *extra]
    if not any(a.startswith(("--rdzv", "--master", "--nnodes")) for a in extra):
        cmd.append("--standalone")
    return [*cmd, script, *script_args]
