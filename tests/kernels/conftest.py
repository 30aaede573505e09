"""One kernel cache and one quickly measured machine for the whole kernels suite: every
kernel compiles once per session (in a temporary folder), later tests reuse it."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_kernel_cache(kernel_cache):  # tests/conftest.py: a temporary cache for the session
    return kernel_cache


@pytest.fixture(scope="session")
def machine(kernel_cache):
    """Measured briefly (50 ms a figure) and saved where the tuner looks for it."""
    from tessera.kernels.machine import measure, save_machine

    m = measure(seconds=0.05)
    save_machine(m)
    return m
