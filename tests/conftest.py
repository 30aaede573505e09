"""Fixtures shared by several test folders."""

import os

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
