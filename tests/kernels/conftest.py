"""One kernel cache and one quickly measured machine (tests/conftest.py) for the whole kernels suite: every
kernel compiles once per session (in a temporary folder), later tests reuse it."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_kernel_cache(kernel_cache):  # tests/conftest.py: a temporary cache for the session
    return kernel_cache

# `machine` (this CPU measured once for the session) is in tests/conftest.py: the kernels
# benchmark's test uses the same one.


@pytest.fixture(scope="session")
def machine(measured_machine):
    return measured_machine
