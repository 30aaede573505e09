"""Fixtures shared by several test folders."""

import os
import re
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory):
    """One temporary kernel cache for the session: every kernel compiles once, later tests
    reuse it, and the user's cache is never touched. The folders whose tests compile kernels
    make it autouse in their own conftest."""
    old = os.environ.get("TESSERA_KERNEL_CACHE")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one cache for all workers (writes are atomic renames)
        path = tmp_path_factory.getbasetemp().parent / "kernel-cache"
        path.mkdir(exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("kernel-cache")
    os.environ["TESSERA_KERNEL_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TESSERA_KERNEL_CACHE", None)
    else:
        os.environ["TESSERA_KERNEL_CACHE"] = old


@pytest.fixture(scope="session")
def measured_machine(kernel_cache):
    """This CPU measured briefly (50 ms a figure) once for the session and saved where the
    tuner looks for it (in the session's kernel cache)."""
    from tessera.kernels.machine import measure, save_machine

    m = measure(seconds=0.05)
    save_machine(m)
    return m


@pytest.fixture(scope="session", autouse=True)
def reused_ranks():
    """spawn() keeps its ranks between tests (one pool per world size): starting a rank (a
    process, torch, the test's imports, the process group) costs seconds, the tests' work
    far less. A test that needs fresh processes passes spawn(..., fresh=True)."""
    from tessera.runtime import launch

    launch.reuse_ranks(True)
    yield
    launch.reuse_ranks(False)


_STARTS_RANKS = re.compile(r"\bspawn\(|--nproc|\bnproc=")


def pytest_collection_modifyitems(config, items):
    """`make test` runs two workers with ``--dist loadgroup``: each test file goes whole to one
    worker (as ``loadfile`` would), except that every file that starts ranks in the test's own
    process (``spawn``, or a CLI run with ``--nproc``) goes to the same one, as one group. Its
    rank pools (``reused_ranks``) then start once for the suite, not once a worker, and two
    multi-rank tests never run at once on the 2 cores."""
    starts: dict[Path, bool] = {}
    for item in items:
        path = item.path
        if path not in starts:
            starts[path] = bool(_STARTS_RANKS.search(path.read_text()))
        group = "ranks" if starts[path] else str(path)
        item.add_marker(pytest.mark.xdist_group(name=group))
