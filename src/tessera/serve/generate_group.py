"""The group of ranks a generation server holds for its life: N processes joined in one
torch.distributed group, each with the model loaded once (``generate_rank.rank_main``).

The server's process supervises them (as ``tessera.runtime.launch.spawn`` supervises a
one-shot run) rather than being rank 0 itself: a rank that raises or dies then ends the
batch with an error naming that rank, and the group is ended and started again, while the
HTTP side stays up. Each batch goes to rank 0, which broadcasts it to the group.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import queue
import time
from collections.abc import Callable

import torch.distributed as dist

from tessera.serve.generate_rank import Batch, Outcome, Shared, rank_main

log = logging.getLogger(__name__)
# a rank whose peer failed fails too, with one of these: a symptom, not the cause
_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Timed out", "Broken pipe")


class GroupError(RuntimeError):
    """A rank raised or died; names the rank and its error."""

    def __init__(self, rank: int | None, message: str, remote_traceback: str = ""):
        self.rank, self.message, self.remote_traceback = rank, message, remote_traceback
        super().__init__(f"rank {rank} failed: {message}" if rank is not None else message)


class RankGroup:
    """``world_size`` rank processes serving batches of ``directory``'s model under ``config``."""

    def __init__(
        self,
        directory: str,
        config,
        *,
        threads: int = 1,
        load_timeout_s: float = 300.0,
        collective_timeout_s: float = 120.0,
        stop_grace_s: float = 30.0,
        vae: dict | None = None,
    ):
        self.directory, self.config = directory, config
        self.world_size = config.world_size
        self.threads, self.load_timeout_s = threads, load_timeout_s
        self.collective_timeout_s, self.stop_grace_s = collective_timeout_s, stop_grace_s
        self.vae = vae  # a pipeline's parallel_vae / vae_chunk_rows
        self.ctx = mp.get_context("spawn")
        self.procs: list = []
        self.pids: list[int] = []
        self.starts = 0

    # ---- life -------------------------------------------------------------------------

    def start(self) -> RankGroup:
        """Start the ranks and wait until each has loaded the model (or one failed)."""
        from tessera.runtime.launch import _RankSpec, default_backend

        self.starts += 1
        self.store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False)
        self.shared = Shared.create(self.ctx, self.world_size)
        self.results = self.ctx.Queue()
        self.tasks = [self.ctx.Queue() for _ in range(self.world_size)]
        self.procs = []
        for rank in range(self.world_size):
            spec = _RankSpec(rank=rank, world_size=self.world_size, port=self.store.port,
                             backend=default_backend(), threads=self.threads,
                             collective_timeout_s=self.collective_timeout_s)  # fmt: skip
            args = (spec, self.directory, self.config, self.tasks[rank], self.results, self.shared, self.vae)
            p = self.ctx.Process(target=rank_main, args=args, daemon=True, name=f"tessera-rank-{rank}")
            p.start()
            self.procs.append(p)
        pids: dict[int, int] = {}
        deadline = time.monotonic() + self.load_timeout_s
        try:
            while len(pids) < self.world_size:
                message = self._next(deadline, f"loading the model took over {self.load_timeout_s:.0f} s")
                if message[0] == "ready":
                    pids[message[1]] = message[2]
        except BaseException:
            self.close()
            raise
        self.pids = [pids[r] for r in range(self.world_size)]
        return self

    def close(self) -> None:
        """Ask every rank to leave, then end those still there."""
        for q in getattr(self, "tasks", []):
            with contextlib.suppress(Exception):
                q.put(None)
        deadline = time.monotonic() + 3.0
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in (*getattr(self, "tasks", []), *([self.results] if hasattr(self, "results") else [])):
            q.close()
            q.cancel_join_thread()
        self.procs = []

    def restart(self) -> None:
        self.close()
        self.start()

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    # ---- one batch --------------------------------------------------------------------

    def run(self, batch: Batch, should_stop: Callable[[], bool]) -> Outcome:
        """Rank 0's outcome of ``batch`` ("done" with the PNGs, or "cancelled" at a step
        boundary once ``should_stop`` said so). Raises GroupError when a rank raises or
        dies, or the group does not stop within ``stop_grace_s`` of being asked: the group
        must then be restarted."""
        self.tasks[0].put(batch)
        for q in self.tasks[1:]:
            q.put("wake")  # the batch itself comes from rank 0, by broadcast
        outcomes: dict[int, Outcome] = {}
        stop_deadline = None
        while len(outcomes) < self.world_size:
            if stop_deadline is None and should_stop():
                stopped_at = self.shared.request_stop(batch.id)
                log.info("batch %d: stopping at step %d", batch.id, stopped_at)
                stop_deadline = time.monotonic() + self.stop_grace_s
            message = self._next(stop_deadline, f"the group did not stop within {self.stop_grace_s:.0f} s",
                                 poll=True)  # fmt: skip
            if message is not None and message[0] == "outcome":
                outcomes[message[1].rank] = message[1]
        return outcomes[0]

    def progress(self, batch_id: int) -> int:
        return self.shared.progress(batch_id)

    def _next(self, deadline: float | None, hung: str, poll: bool = False):
        """The next report of a rank; a failure (an error report, a rank gone) raised as
        GroupError with its root cause; past ``deadline``, GroupError(``hung``)."""
        while True:
            try:
                message = self.results.get(timeout=0.1)
            except queue.Empty:
                self._check_dead()
                if deadline is not None and time.monotonic() > deadline:
                    raise GroupError(None, hung) from None
                if poll:
                    return None
                continue
            if message[0] == "error":
                self._raise_root_cause({message[1]: (message[2], message[3])})
            return message

    def _check_dead(self) -> None:
        if any(p.exitcode is not None for p in self.procs):
            self._raise_root_cause({})

    def _raise_root_cause(self, errors: dict) -> None:
        """A rank that died without a word (killed, crashed) is the cause; else the first
        error that is not a symptom of a peer's failure."""
        grace = time.monotonic() + 1.0  # peers of a failed rank fail next: wait for the cause
        while time.monotonic() < grace:
            try:
                message = self.results.get(timeout=0.1)
            except queue.Empty:
                continue
            if message[0] == "error":
                errors.setdefault(message[1], (message[2], message[3]))
        dead = [
            (r, p.exitcode)
            for r, p in enumerate(self.procs)
            if p.exitcode not in (None, 1) and r not in errors
        ]
        if dead:
            rank, code = dead[0]
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise GroupError(rank, f"the process was {how}")
        if not errors:
            raise GroupError(None, "a rank exited without a report")
        causes = [r for r, (m, _) in errors.items() if not any(s in m for s in _SYMPTOMS)]
        rank = causes[0] if causes else min(errors)
        message, tb = errors[rank]
        raise GroupError(rank, message, tb)

    def check(self) -> None:
        """Raise GroupError if a rank is gone (between batches)."""
        if self.procs and not self.alive():
            self._raise_root_cause({})
