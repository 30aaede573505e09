"""`tessera bench dit-video`'s text-encoder table on a tiny saved PixArt: held once, rank 1
holds the pipeline's parameters less exactly the text encoder's, rank 0 all of them, and
every rank all of them when each loads the encoder. Parameter bytes only: resident memory
is the bench's to measure (in fresh processes), not a test's to assert."""

import sys
from pathlib import Path

import pytest
import torch

from tessera.bench.dit_text_memory import TEXT_COLUMNS, measure_text_encoder_memory, text_memory_rows

sys.path.insert(0, str(Path(__file__).parents[1] / "diffusion"))

MIB = 2**20


@pytest.fixture(scope="module")
def pixart(tmp_path_factory):
    from tiny_pipelines import build_pixart_pipeline

    return build_pixart_pipeline(tmp_path_factory.mktemp("text-memory") / "pixart")


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_rank1_holds_the_pipeline_less_its_text_encoder(pixart):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(pixart, local_files_only=True)
    whole = sum(_bytes(c) for c in pipe.components.values() if isinstance(c, torch.nn.Module))
    encoder = _bytes(pipe.text_encoder)
    assert 0 < encoder < whole

    # pooled ranks: their parameter bytes are what this load holds, whatever ran before
    measured = measure_text_encoder_memory(str(pixart), fresh=False)
    assert [r["params"] for r in measured["before"]] == [whole, whole]
    assert [r["params"] for r in measured["after"]] == [whole, whole - encoder]
    assert [r["text_encoder"] for r in measured["after"]] == [True, False]
    for way in measured.values():
        assert all(r["rss_loaded"] > 0 and r["rss_imports"] > 0 for r in way)

    rows = text_memory_rows(measured)
    assert [list(r) for r in rows] == [TEXT_COLUMNS, TEXT_COLUMNS]
    assert rows[1]["params_mib_after"] == round((whole - encoder) / MIB, 2)
    assert rows[0]["params_mib_after"] == rows[0]["params_mib_before"] == round(whole / MIB, 2)
