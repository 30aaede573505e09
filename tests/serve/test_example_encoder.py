"""`tessera serve --make-example-model DIR` writes an encoder folder the server serves: its
tokenizer knows English words (none of an ordinary sentence is [UNK]) and the server embeds
two different texts to different vectors."""

import httpx
import pytest
import torch
from live import thread_server

from tessera import cli
from tessera.serve.server import ServeConfig
from tessera.serve.synthetic import save_example_encoder

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Serving many short requests, sorted by length!"]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return save_example_encoder(tmp_path_factory.mktemp("example") / "enc", max_length=64)


def test_ordinary_words_are_not_unknown(example):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(example)
    for sentence in SENTENCES + ["Café au lait, naïve résumé 2024"]:  # accents are stripped, as BERT's
        tokens = tokenizer.tokenize(sentence)
        assert tokenizer.unk_token not in tokens, tokens
    assert tokenizer.tokenize("The Function returns") == ["the", "function", "returns"]  # whole words


def test_the_server_embeds_two_texts_to_different_vectors(example):
    with thread_server(ServeConfig(model=str(example), port=0)) as (url, _):
        reply = httpx.post(f"{url}/embed", json={"inputs": SENTENCES}, timeout=60)
    assert reply.status_code == 200, reply.text
    first, second = torch.tensor(reply.json())
    assert (
        first.shape == (128,) and (first - second).abs().max() > 1e-3
    )  # unit vectors; 1e-3 is far above rounding


def test_the_command_writes_one_and_refuses_what_it_cannot(tmp_path, capsys):
    assert cli.main(["serve", "--make-example-model", str(tmp_path / "enc")]) == 0
    assert f"serve it with: tessera serve --model {tmp_path / 'enc'}" in capsys.readouterr().out
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {
        p.name for p in (tmp_path / "enc").iterdir()
    }
    for argv, message in (
        (["serve", "--make-example-model", str(tmp_path / "enc")], "is not an empty folder"),
        (["serve"], "give --model DIR"),
        (["serve", "--model", "a", "--make-example-model", "b"], "give one"),
    ):
        assert cli.main(argv) == 2
        assert message in capsys.readouterr().err
