"""`tessera launch`: torchrun's flags in both forms, and examples/launch_train.py run under
it on one node and on two nodes (two agents on 127.0.0.1, c10d rendezvous)."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.runtime.launch_cli import split_launch_args, torchrun_command

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "launch_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 300  # only against a hang: six processes import torch on 2 shared cores (~50 s seen under load)

RENDEZVOUS = {
    "space": ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "job7", "--node-rank", "1",
              "--max-restarts", "0", "--master-addr", "10.0.0.1", "--master-port", "29500"],
    "equals": ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
               "--rdzv_endpoint=10.0.0.1:29400", "--rdzv_id=job7", "--node_rank=1",
               "--max_restarts=0", "--master_addr=10.0.0.1", "--master_port=29500"],
}  # fmt: skip


@pytest.mark.parametrize("form", sorted(RENDEZVOUS))
def test_torchrun_flags_split_in_both_forms(form):
    flags = RENDEZVOUS[form]
    launch = split_launch_args([*flags, "train.py", "--steps", "2"])
    assert launch.torchrun_flags == tuple(flags) and launch.nproc is None
    assert launch.script == "train.py" and launch.script_args == ("--steps", "2")
    cmd = torchrun_command(launch.nproc, launch.script, list(launch.script_args), list(launch.torchrun_flags))
    assert cmd == ["torchrun", *flags, "train.py", "--steps", "2"]  # a rendezvous: no --standalone


@pytest.mark.parametrize("nproc", [["-n", "2"], ["-n2"], ["-n=2"], ["--nproc", "2"], ["--nproc=2"]])
def test_tesseras_own_nproc_becomes_nproc_per_node(nproc):
    launch = split_launch_args([*nproc, "--max-restarts", "1", "--checkpoint-dir=ck", "train.py"])
    assert launch.nproc == 2 and launch.torchrun_flags == ("--max-restarts", "1")
    cmd = torchrun_command(launch.nproc, launch.script, [], list(launch.torchrun_flags))
    assert cmd == ["torchrun", "--nproc-per-node=2", "--standalone", "--max-restarts", "1", "train.py"]


def test_checkpoint_flags_reach_the_workers_and_restarts_need_them():
    flags = ["--nnodes", "1:2", "--max-restarts", "3", "--checkpoint-dir", "ck", "--checkpoint-every", "5"]
    launch = split_launch_args([*flags, "train.py", "--checkpoint-dir", "mine"])
    assert launch.torchrun_flags == ("--nnodes", "1:2", "--max-restarts", "3")  # --nnodes MIN:MAX passes
    assert launch.script_args == ("--checkpoint-dir", "mine")  # after the script: the script's own
    assert launch.worker_env() == {
        "TESSERA_CHECKPOINT_DIR": "ck",
        "TESSERA_CHECKPOINT_EVERY": "5",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
    }
    with pytest.raises(ValueError, match="--max-restarts 2 needs --checkpoint-dir: a restarted job resumes"):
        split_launch_args(["--max-restarts", "2", "train.py"])
    with pytest.raises(ValueError, match="--checkpoint-every needs --checkpoint-dir"):
        split_launch_args(["--checkpoint-every", "2", "train.py"])
    assert split_launch_args(["--max-restarts", "0", "train.py"]).worker_env() == {}


def test_boolean_flags_take_no_value_and_script_flags_stay_with_the_script():
    launch = split_launch_args(
        ["--standalone", "-m", "-n", "2", "pkg.train", "--nnodes", "3", "-n", "4", "-h"]
    )
    assert launch.torchrun_flags == ("--standalone", "-m") and launch.nproc == 2
    assert launch.script == "pkg.train" and launch.script_args == ("--nnodes", "3", "-n", "4", "-h")
    assert not launch.script_is_file  # a module name under -m
    launch = split_launch_args(["--no-python", "--virtual-local-rank", "echo", "hi"])
    assert launch.torchrun_flags == ("--no-python", "--virtual-local-rank") and launch.script == "echo"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "2", "--nproc-per-node", "4", "t.py"], "-n 2 and --nproc-per-node 4 both set"),
        (["--nodes", "2", "t.py"], "unknown flag.*--nodes"),
        (["-n", "0", "t.py"], "expected a positive integer, got 0"),
        (["-n", "2"], "no script given; usage: tessera launch"),
        (["t.py", "--nnodes"], None),  # after the script: the script's own flag
    ],
)
def test_mistakes_are_one_line_errors(argv, message):
    if message is None:
        assert split_launch_args(argv).script_args == ("--nnodes",)
        return
    with pytest.raises(ValueError, match=message) as info:
        split_launch_args(argv)
    assert "\n" not in str(info.value)


def test_cli_refuses_a_missing_script_in_one_line(capsys, tmp_path):
    assert main(["launch", "--nnodes", "1", str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "missing.py does not exist" in err


def test_docs_show_the_example_verbatim():
    assert f"```python\n{EXAMPLE.read_text()}```\n" in (ROOT / "docs" / "launch.md").read_text()


def _launch(*flags: str, steps: int = 2) -> list[str]:
    return [sys.executable, "-m", "tessera.cli", "launch", *flags, str(EXAMPLE), "--steps", str(steps)]


def _run_together(commands: list[list[str]]) -> list[tuple[int, str, str]]:
    """Run the commands at once; (exit status, stdout, stderr) of each. On a timeout every
    process group is ended: SIGTERM first, so each torchrun agent ends its workers (they live
    in sessions of their own), then SIGKILL."""
    procs = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True
        )
        for cmd in commands
    ]
    try:
        outputs = [proc.communicate(timeout=TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                _end_group(proc)
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs, strict=True)]


def _end_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.communicate(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def test_example_trains_on_one_node():
    [(status, out, err)] = _run_together([_launch("-n", "2")])
    assert status == 0, err[-3000:]
    assert "step 1: loss" in out
    assert "rank 0/2:" in out and "rank 1/2:" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_example_trains_on_two_nodes_with_c10d_rendezvous():
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    rendezvous += ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", uuid.uuid4().hex]
    nodes = _run_together([_launch(*rendezvous, "--node-rank", str(i)) for i in range(2)])
    for status, _, err in nodes:
        assert status == 0, err[-3000:]
    stdout = "".join(out for _, out, _ in nodes)
    # c10d assigns ranks in the order the agents join, not by --node-rank
    assert "rank 0/2:" in stdout and "rank 1/2:" in stdout
