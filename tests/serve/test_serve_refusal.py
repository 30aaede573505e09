"""`tessera serve` refuses what it can know before it loads the model (issue #25): a port
in use, a cost table it could not write, a memory plan without the unpadded runner. Each
used to surface after the model was loaded (and the cost table measured, which takes
minutes on a real model); now each is a one-line error and the model is never loaded."""

import socket

import pytest

from tessera import cli
from tessera.serve import server


@pytest.fixture
def loads(monkeypatch):
    """The model folders the server tried to load (none, for a refusal)."""
    calls = []

    def load_model(path, **kwargs):
        calls.append(path)
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(server, "load_model", load_model)
    return calls


def _error_of(capsys, argv) -> str:
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("tessera: error: "), err
    return err


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path, capsys, loads):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _error_of(capsys, ["serve", "--model", str(tmp_path), "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use): choose another port" in err
    assert loads == []


def test_settings_that_cannot_work_are_refused_before_the_model_loads(tmp_path, capsys, loads):
    serve = ["serve", "--model", str(tmp_path), "--port", "0"]
    err = _error_of(capsys, [*serve, "--cost-table", str(tmp_path / "no" / "cost.json")])
    assert f"cannot write the cost table {tmp_path / 'no' / 'cost.json'}: give a file path" in err
    err = _error_of(capsys, [*serve, "--memory-plan", "--scheduler", "fifo_padded"])
    assert "the memory plan is the unpadded runner's; runner is padded" in err
    err = _error_of(capsys, [*serve, "--amx", "off", "--kernels", "torch"])
    assert "--amx off chooses how Tessera's dense kernels run; --kernels torch runs torch's" in err
    assert loads == []


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--task", "embed", "--nproc", "2", "--ulysses", "2"], "--nproc, --ulysses are read by generation"),
        (["--task", "classify", "--parallel-vae"], "--parallel-vae is read by generation"),
        (
            ["--task", "generate", "--pooling", "cls", "--max-batch-size", "4"],
            "--pooling, --max-batch-size are read by encoders",
        ),
        (["--task", "generate", "--amx", "off"], "--amx is read by encoders"),
    ],
)
def test_a_flag_the_task_does_not_read_is_refused(capsys, loads, tmp_path, argv, named):
    """serve's encoder flags given to generation (and generation's to an encoder) would be
    ignored: refused in one line before anything loads."""
    err = _error_of(capsys, ["serve", "--model", str(tmp_path), "--port", "0", *argv])
    assert named in err and str(tmp_path) in err, err
    assert loads == []
