"""One kernel cache (a temporary folder) for the stencil tests, and a machine described by
hand (the model's tests must not depend on a measurement taken on a loaded machine)."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_kernel_cache(kernel_cache):  # tests/conftest.py: a temporary cache for the session
    return kernel_cache


@pytest.fixture(scope="session")
def machine():
    """A 2-core AVX2 machine with this VM's committed figures (benchmarks/results/machine.md)."""
    from tessera.kernels.machine import Machine

    return Machine(
        isa="avx2", cores=2, cache_bytes={"L1": 48 << 10, "L2": 1 << 20, "L3": 32 << 20},
        cache_shared_by={"L1": 1, "L2": 1, "L3": 2}, peak_flops={"avx2": {1: 135e9, 2: 268e9}},
        read_bw={"L1": {1: 530e9, 2: 1050e9}, "L2": {1: 266e9, 2: 526e9}, "L3": {1: 118e9, 2: 249e9},
                 "DRAM": {1: 39.6e9, 2: 43.9e9}},
        write_bw={1: 32.2e9, 2: 33.6e9}, fingerprint="stencil-tests", isas=("avx2",),
    )
