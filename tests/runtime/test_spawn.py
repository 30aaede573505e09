"""spawn(): return values, and a failing rank surfaces fast instead of hanging its peers."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tessera.runtime import RankError, spawn


def _rank_and_threads() -> tuple[int, int, str]:
    return dist.get_rank(), torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]


def _rank_one_raises_others_block() -> None:
    if dist.get_rank() == 1:
        raise ValueError("bad value on rank one")
    dist.all_reduce(torch.ones(1))  # would wait forever for rank 1 without the launcher
    time.sleep(600)


def _rank_zero_dies() -> None:
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def _sleeps() -> None:
    time.sleep(600)


def test_returns_values_in_rank_order_with_one_thread_each():
    assert spawn(_rank_and_threads, 2) == [(0, 1, "1"), (1, 1, "1")]


def test_raising_rank_reaches_caller_quickly_with_traceback():
    began = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(_rank_one_raises_others_block, 3, timeout_s=120)
    assert info.value.rank == 1
    assert "ValueError: bad value on rank one" in str(info.value)
    assert "_rank_one_raises_others_block" in info.value.remote_traceback
    assert time.monotonic() - began < 60  # start-up (~2 s a rank) plus the kill, no hang


def test_rank_that_dies_without_raising_is_reported():
    with pytest.raises(RankError, match="rank 0 failed: process exited with code 3"):
        spawn(_rank_zero_dies, 2, timeout_s=120)


def test_timeout_names_the_ranks_still_running():
    with pytest.raises(TimeoutError, match=r"ranks still running: \[0, 1\]"):
        # 2 s: the ranks never return, so any deadline ends in the same error; the ranks of the
        # pool are already running (the test above used two), and a fresh start would still be
        # "running" when the deadline passes
        spawn(_sleeps, 2, timeout_s=2)


TQDM_SCRIPT = """
from tessera.runtime import spawn


def bars():
    from tqdm import tqdm

    for _ in tqdm(range(3)):  # tqdm makes a process lock: a semaphore the rank must release
        pass
    return 1


if __name__ == "__main__":
    print(spawn(bars, 2))
"""


def test_ranks_that_reported_shut_down_cleanly(tmp_path):
    """Ranks that returned are let to finish their own shutdown: terminating them there left
    tqdm's lock to the resource tracker, which warned of leaked semaphores after `make demo`."""
    import subprocess
    import sys

    script = tmp_path / "bars.py"
    script.write_text(TQDM_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("[1, 1]")
    assert "leaked semaphore" not in done.stderr, done.stderr


class _FlushesOnCollection:
    """A writer that saves what it holds when it is collected (as a buffered log does)."""

    def __init__(self, path: str):
        self.path, self.held, self.me = path, "held by a rank's unfinished writer\n", self

    def __del__(self):
        with open(self.path, "w") as f:
            f.write(self.held)


def _leaves_a_writer_behind(path: str) -> int:
    _FlushesOnCollection(path)  # refers to itself: only a garbage collection finalizes it
    return 0


def test_a_writer_a_rank_left_behind_is_finalized(tmp_path):
    """Ranks skip the interpreter's teardown, which would collect garbage and run finalizers:
    the rank collects first, so a finalizer that saves data still runs."""
    path = tmp_path / "left_behind.txt"
    assert spawn(_leaves_a_writer_behind, 1, str(path), fresh=True) == [0]  # the exit is what is tested
    assert path.read_text() == "held by a rank's unfinished writer\n"


def _pid_and_groups(seed_draw: bool) -> tuple[int, int, float]:
    from tessera.runtime import Mesh

    Mesh(dp=dist.get_world_size())  # makes process groups of its own
    draw = float(torch.rand(1)) if seed_draw else 0.0
    torch.set_default_dtype(torch.float64)  # put back before the next call
    return os.getpid(), 0, draw


def test_reused_ranks_start_each_call_as_fresh_ones():
    """The suite reuses ranks between calls (``reuse_ranks``): the same processes serve the
    next call, torch's generator starts each call from the
    same seed (a fresh process's is random: no test may depend on it), and a failure ends
    the pool so the next call gets new ranks."""
    from tessera.runtime import launch

    if not launch._pooling:
        pytest.skip("ranks are reused only under the test suite's set-up")
    first = spawn(_pid_and_groups, 2, True)
    second = spawn(_pid_and_groups, 2, True)
    assert [p for p, _, _ in first] == [p for p, _, _ in second]  # the same ranks
    assert [d for _, _, d in first] == [d for _, _, d in second]  # each call from the same seed
    with pytest.raises(RankError):
        spawn(_rank_one_raises_others_block, 2, timeout_s=60)
    after = spawn(_pid_and_groups, 2, False)
    assert not {p for p, _, _ in after} & {p for p, _, _ in first}  # a failure ended the pool


def _pid() -> int:
    return os.getpid()


def test_pools_beyond_the_rank_budget_are_ended(monkeypatch):
    """Pooled ranks hold ~0.5 GB each: a new pool ends the least recently used ones beyond
    MAX_POOLED_RANKS (here 1), so their processes are gone."""
    from tessera.runtime import launch

    if not launch._pooling:
        pytest.skip("ranks are reused only under the test suite's set-up")
    monkeypatch.setattr(launch, "_POOLS", {})  # the suite's own pools stay as they are
    monkeypatch.setattr(launch, "MAX_POOLED_RANKS", 1)
    try:
        [first] = spawn(_pid, 1)
        [second] = spawn(_pid, 1, threads_per_rank=2)  # another key: another pool
        assert second != first and [k.threads for k in launch._POOLS] == [2]
        with pytest.raises(ProcessLookupError):  # ended (and reaped)
            os.kill(first, 0)
        assert spawn(_pid, 1, threads_per_rank=2) == [second]  # the pool that stayed is reused
    finally:
        launch.close_pools()
