"""One kernel cache and one quickly measured machine for the whole kernels suite: every
kernel compiles once per session (in a temporary folder), later tests reuse it."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    old = os.environ.get("TESSERA_KERNEL_CACHE")
    path = tmp_path_factory.mktemp("kernel-cache")
    os.environ["TESSERA_KERNEL_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TESSERA_KERNEL_CACHE", None)
    else:
        os.environ["TESSERA_KERNEL_CACHE"] = old


@pytest.fixture(scope="session")
def machine(kernel_cache):
    """Measured briefly (50 ms a figure) and saved where the tuner looks for it."""
    from tessera.kernels.machine import measure, save_machine

    m = measure(seconds=0.05)
    save_machine(m)
    return m
