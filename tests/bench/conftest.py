"""Benchmarks that start Tessera servers or compile kernels do it in the session's temporary
kernel cache (tests/conftest.py; servers inherit it through the environment), with the
machine measured there once."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_kernel_cache(measured_machine):
    return measured_machine
