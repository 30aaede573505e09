import pytest
import torch

from tessera.runtime import Mesh
from tessera.runtime.launch_cli import torchrun_command


def test_single_process_mesh_of_size_one_needs_no_process_group():
    mesh = Mesh(dp=1, tp=1)
    assert mesh.size() == 1 and mesh.coords == {"dp": 0, "tp": 0}
    assert mesh.group("dp") is None
    t = torch.ones(3)
    mesh.comm.all_reduce(t, "dp")  # nothing moves along a size-1 axis
    assert mesh.comm.all_gather(t, "tp") is t
    assert mesh.comm.ledger.total() == 0


def test_product_must_equal_world_size():
    with pytest.raises(ValueError, match=r"dp=2 x pp=2 has 4 ranks but the world size is 1"):
        Mesh(dp=2, pp=2)


@pytest.mark.parametrize(
    "axes, message",
    [
        ({}, "at least one axis"),
        ({"dp": 0}, "dp=0"),
        ({"dp": 1.5}, "dp=1.5"),
        ({"dp": True}, "dp=True"),
    ],
)
def test_invalid_axes(axes, message):
    with pytest.raises(ValueError, match=message):
        Mesh(**axes)


def test_unknown_axis_is_named():
    with pytest.raises(ValueError, match=r"no axis 'pp'.*\['dp'\]"):
        Mesh(dp=1).size("pp")


def test_torchrun_command_passes_multinode_flags_through():
    single = torchrun_command(4, "train.py", ["--lr", "1"], [])
    assert single == ["torchrun", "--nproc-per-node=4", "--standalone", "train.py", "--lr", "1"]
    multi = torchrun_command(8, "train.py", [], ["--nnodes=2", "--rdzv-endpoint=host:29400"])
    assert "--standalone" not in multi and "--nnodes=2" in multi
    with pytest.raises(ValueError, match="--nproc must be >= 1, got 0"):
        torchrun_command(0, "train.py", [], [])


def test_tessera_launch_runs_a_script_under_torchrun(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "launch_probe.py"
    out = tmp_path / "probe"
    cmd = [sys.executable, "-m", "tessera.cli", "launch", "-n", "2", str(script), str(out), "--flag", "x"]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in range(2):
        report = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert report["sum"] == 3.0 and report["extra"] == ["--flag", "x"]  # script args pass through
        assert report["ledger"] == {"all_reduce@dp": {"bytes": 4, "calls": 1}}



def test_exit_waits_while_another_thread_is_runnable():
    """release_device_meshes (run at exit) sleeps while another thread of the process is
    runnable, so that a gloo worker preempted after its collective drops the collective's
    tensors before the interpreter finalises; a parked thread does not hold it up, a thread
    that never parks holds it up for the timeout only."""
    import hashlib
    import threading

    from tessera.runtime.mesh import let_runnable_threads_park

    parked = threading.Event()
    waiter = threading.Thread(target=parked.wait)
    waiter.start()
    try:
        assert let_runnable_threads_park(timeout_s=30.0)  # a thread waiting on an event is asleep
    finally:
        parked.set()
        waiter.join()

    began = threading.Event()

    def busy():  # pbkdf2 releases the GIL: runnable, in C, for about a second on these cores
        began.set()
        hashlib.pbkdf2_hmac("sha256", b"tessera", b"salt", 4_000_000)

    worker = threading.Thread(target=busy)
    worker.start()
    began.wait()
    try:
        assert not let_runnable_threads_park(timeout_s=0.05)  # still runnable: gives up at the bound
        assert worker.is_alive()
    finally:
        worker.join()
