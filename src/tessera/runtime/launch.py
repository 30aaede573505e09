"""Starting ranks: `spawn()` for local multi-process runs, `init_from_env()` under torchrun.

`spawn` is what tests, benchmarks and the CLI use on one machine. The parent process owns
the rendezvous store (a TCPStore on an OS-assigned port, so concurrent runs never collide
and no port is ever guessed), watches every child, and turns the first failure into an
exception in the caller while ending the other ranks: a rank that raises can never leave
its peers blocked in a collective.
"""

from __future__ import annotations

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
# ranks kept alive in all pools together (each holds torch and the tests' imports, 0.3-0.6 GB
# resident, much of it torch's shared libraries): a new pool ends the least recently used ones
# beyond it. 14 keeps pools of 2, 4 and 8 ranks at once: with 10, an 8-rank test ended the
# 2- and 4-rank pools that the tests after it then started again (a run of the suite logged
# 21 pool starts, about a third of them such restarts)
MAX_POOLED_RANKS = 14


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
