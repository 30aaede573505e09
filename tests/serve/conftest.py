"""Tiny encoders of every served family, built once per test session from configs (random
weights, a word-level tokenizer made in code) and saved with save_pretrained."""

import pytest
from live import SLOW_SPEC, SPEC

from tessera.serve.synthetic import FAMILIES, EncoderSpec, build_encoder


@pytest.fixture(scope="session", autouse=True)
def _isolated_kernel_cache(measured_machine):
    """The runner's dense and attention kernels compile into the session's temporary cache
    (tests/conftest.py), with the machine measured there once; the user's is never touched."""
    return measured_machine


TINY = {"layers": 2, "hidden": 32, "heads": 4, "vocab_size": 200, "max_length": 64}


@pytest.fixture(scope="session")
def encoder_dirs(tmp_path_factory):
    """{(family, task): folder} for task in embed / classify."""
    root = tmp_path_factory.mktemp("encoders")
    dirs = {}
    for i, family in enumerate(FAMILIES):
        for task, labels in (("embed", 0), ("classify", 3)):
            spec = EncoderSpec(family=family, num_labels=labels, seed=i, **TINY)
            dirs[family, task] = build_encoder(root / f"{family}-{task}", spec)
    return dirs


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The encoder the server tests serve (4 layers, 64 wide, inputs up to 256 tokens)."""
    return build_encoder(tmp_path_factory.mktemp("served") / "enc", SPEC)


@pytest.fixture(scope="session")
def slow_dir(tmp_path_factory):
    """A wider encoder, for tests that need a busy engine."""
    return build_encoder(tmp_path_factory.mktemp("served") / "slow", SLOW_SPEC)
