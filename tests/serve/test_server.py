"""The HTTP server, real (uvicorn on a free loopback port): TEI and OpenAI routes answer
what the one-request-at-a-time model computes, metrics count what happened, and every
refusal has its status and names its cause."""

import base64
import json
import socket

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from live import ATOL, metric, text, thread_server

from tessera.serve.model import load_model, reference_outputs
from tessera.serve.server import ServeConfig
from tessera.serve.synthetic import EncoderSpec, build_encoder


@pytest.fixture(scope="module")
def server(model_dir):
    config = ServeConfig(model=str(model_dir), port=0, max_queue=31, payload_limit=40_000)
    with thread_server(config) as (url, service):
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client, service


def expected(service, texts, normalize=True):
    ids = service.served.tokenizer(texts)["input_ids"]
    rows = reference_outputs(service.served, ids)
    return F.normalize(rows, dim=-1) if normalize else rows


def test_embed_equals_the_model_one_request_at_a_time(server):
    client, service = server
    texts = [text(n, seed=n) for n in (5, 200, 17, 256, 2)]
    got = client.post("/embed", json={"inputs": texts})
    assert got.status_code == 200, got.text
    torch.testing.assert_close(torch.tensor(got.json()), expected(service, texts), atol=ATOL, rtol=ATOL)
    assert int(got.headers["x-compute-tokens"]) == 5 + 200 + 17 + 256 + 2
    one = client.post("/embed", json={"inputs": texts[1], "normalize": False}).json()
    torch.testing.assert_close(
        torch.tensor(one[0]), expected(service, texts[1:2], False)[0], atol=ATOL, rtol=ATOL
    )


def test_openai_embeddings_with_usage_base64_token_ids_and_dimensions(server):
    client, service = server
    texts = [text(40, seed=1), text(9, seed=2)]
    body = client.post("/v1/embeddings", json={"input": texts, "model": "m"}).json()
    assert body["object"] == "list" and body["model"] == "m"
    assert body["usage"] == {"prompt_tokens": 49, "total_tokens": 49}
    vectors = torch.tensor([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])])
    torch.testing.assert_close(vectors, expected(service, texts), atol=ATOL, rtol=ATOL)
    b64 = client.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, vectors[0].numpy(), atol=1e-7)  # the same float32 bytes
    ids = service.served.tokenizer(texts[1])["input_ids"]
    by_ids = client.post("/v1/embeddings", json={"input": ids}).json()
    torch.testing.assert_close(torch.tensor(by_ids["data"][0]["embedding"]), vectors[1], atol=ATOL, rtol=ATOL)
    short = client.post("/v1/embeddings", json={"input": texts[0], "dimensions": 8}).json()
    torch.testing.assert_close(
        torch.tensor(short["data"][0]["embedding"]), F.normalize(vectors[0, :8], dim=0), atol=ATOL, rtol=ATOL
    )


def test_info_health_metrics_and_docs(server):
    client, _ = server
    info = client.get("/info").json()
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256 and info["max_batch_tokens"] == 16384
    assert (
        info["tessera"]["scheduler"]["name"] == "dp" and info["tessera"]["scheduler"]["cost_table"]["seconds"]
    )
    assert client.get("/health").json() == {"status": "ok"}
    before = metric(client, "tessera_requests_total", route="/embed", outcome="ok")
    client.post("/embed", json={"inputs": ["w1 w2", "w3"]})
    assert metric(client, "tessera_requests_total", route="/embed", outcome="ok") == before + 1
    for name in ("tessera_batch_size_count", "tessera_batch_tokens_sum", "tessera_tokenization_seconds_count",
                 "tessera_queue_seconds_count", "tessera_inference_seconds_count", "tessera_queue_size"):  # fmt: skip
        assert metric(client, name) >= 0
    assert metric(client, "tessera_batch_tokens_sum") >= 7
    spec = client.get("/openapi.json").json()
    assert {"/embed", "/predict", "/v1/embeddings", "/info", "/health", "/metrics"} <= set(spec["paths"])
    assert client.get("/docs").status_code == 200


def test_dense_layers_run_on_tessera_kernels_at_token_counts_never_tuned_for(server):
    """The default server runs its dense layers on Tessera's kernels (a C compiler is here);
    they were tuned at one token count (256) and take any: a batch of 1 token and one of the
    longest input are served as the model alone computes them, and /info counts the rows."""
    client, service = server
    runner = client.get("/info").json()["tessera"]["runner"]
    assert runner["kernels"] == "tessera" and runner["tuning"] == "model" and runner["dense_shapes"]
    rows_before = runner["dense_rows"]
    for texts in (["w1"], [text(254, seed=11)]):
        got = torch.tensor(client.post("/embed", json={"inputs": texts}).json())
        torch.testing.assert_close(got, expected(service, texts), atol=ATOL, rtol=ATOL)
    after = client.get("/info").json()["tessera"]["runner"]
    assert after["dense_rows"] > rows_before + 256  # the long input's rows went through the kernels


def test_two_workers_serve_what_the_model_computes(model_dir):
    """--workers 2: two runners on model copies, one thread each; both answer like the model."""
    texts = [text(n, seed=n) for n in (3, 40, 9, 120, 17, 60, 5, 200)]
    threads = torch.get_num_threads()  # the server sets one thread a worker, for this process
    config = ServeConfig(model=str(model_dir), port=0, workers=2, max_batch_size=2)
    with thread_server(config) as (url, service):
        info = httpx.get(url + "/info").json()["tessera"]
        assert info["workers"] == 2 and info["threads_per_worker"] == 1 and info["workers_setting"] == 2
        for t in texts:  # one at a time and all at once
            got = torch.tensor(httpx.post(url + "/embed", json={"inputs": [t]}).json())
            torch.testing.assert_close(got, expected(service, [t]), atol=ATOL, rtol=ATOL)
        got = torch.tensor(httpx.post(url + "/embed", json={"inputs": texts}).json())
        torch.testing.assert_close(got, expected(service, texts), atol=ATOL, rtol=ATOL)
        runners = service.backend.engine.runners
        assert all(r.dense.counts["calls"] for r in runners)  # both worked
        first, second = (r.dense.describe() for r in runners)
        # one packed copy of the weights: the second worker holds none of its own
        assert first["packed_weights_mib"] > 0 and second["packed_weights_mib"] == 0
        assert second["shared_packed_weights_mib"] == first["packed_weights_mib"]
        assert runners[0].dense.swaps[-1][1].packed is runners[1].dense.swaps[-1][1].packed
        assert runners[0].dense.pool is not runners[1].dense.pool  # own output buffers
    torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="workers must be a positive integer or 'auto', got 0"):
        ServeConfig(model="unused", workers=0)


def test_workers_default_to_one_per_core():
    """The default (the two-core phase of `tessera bench serve` chose it): one single-thread
    worker per core this process may run on; --threads N divides the cores among them."""
    import os

    cores = len(os.sched_getaffinity(0))
    assert ServeConfig(model="unused").workers == "auto"
    assert ServeConfig(model="unused").worker_count == cores
    assert ServeConfig(model="unused", threads=2).worker_count == max(1, cores // 2)
    assert ServeConfig(model="unused", workers=3).worker_count == 3


def test_kernels_flag_is_checked_before_the_model_loads():
    with pytest.raises(ValueError, match="kernels must be one of auto, tessera, torch, got 'cuda'"):
        ServeConfig(model="unused", kernels="cuda")
    with pytest.raises(ValueError, match="--kernels tessera is the unpadded runner's; runner is padded"):
        ServeConfig(model="unused", kernels="tessera", scheduler="fifo_padded")
    assert ServeConfig(model="unused", attention="padded", memory_plan=True).kernels_name == "torch"


def test_too_long_inputs_are_refused_or_truncated_and_said(server):
    client, service = server
    long = text(300, seed=3)
    refused = client.post("/embed", json={"inputs": ["w1", long]})
    assert refused.status_code == 422
    assert refused.json() == {
        "error": "input 1 has 300 tokens; the model takes at most 256: shorten it or set truncate to true",
        "error_type": "Validation",
    }
    cut = client.post("/embed", json={"inputs": ["w1", long], "truncate": True})
    assert cut.status_code == 200 and cut.headers["x-truncated-inputs"] == "1"
    ids = service.served.tokenizer(long, truncation=True, max_length=256)["input_ids"]
    assert len(ids) == 256
    ref = F.normalize(reference_outputs(service.served, [ids]), dim=-1)[0]
    torch.testing.assert_close(torch.tensor(cut.json()[1]), ref, atol=ATOL, rtol=ATOL)
    assert "x-truncated-inputs" not in client.post("/embed", json={"inputs": "w1"}).headers


@pytest.mark.parametrize(
    "body,status,message",
    [
        (b'{"inputs": ["w1"', 422, "body is not valid JSON"),
        (b'{"inputs": 3}', 422, "inputs"),
        (b'{"inputs": "w1", "colour": "red"}', 422, "colour: Extra inputs are not permitted"),
        (b"{}", 422, "inputs: Field required"),
        (b'{"inputs": []}', 422, "inputs must not be empty"),
        (json.dumps({"inputs": ["w1"] * 33}).encode(), 422, "33 inputs in one request; at most 32"),
        (json.dumps({"inputs": "w1 " * 20_000}).encode(), 413, "over the limit of 40000 bytes"),
    ],
)
def test_bad_requests_name_what_is_wrong(server, body, status, message):
    client, _ = server
    got = client.post("/embed", content=body, headers={"content-type": "application/json"})
    assert got.status_code == status, got.text
    assert message in got.json()["error"]


def test_openai_route_errors_name_its_own_field(server):
    """OpenAI's embeddings API calls the texts ``input`` and has no ``truncate``: its errors say so."""
    client, service = server
    vocab = service.served.config.vocab_size
    for body, message in (
        ({"input": []}, "input must not be empty"),
        (
            {"input": ["w1", text(300, seed=3)]},
            "input[1] has 300 tokens; the model takes at most 256: shorten it",
        ),
        ({"input": [[1, 2], [vocab]]}, f"input[1]: token id {vocab} is outside the vocabulary"),
        ({"input": ["w1"] * 33}, "33 items in input in one request; at most 32"),
    ):
        got = client.post("/v1/embeddings", json=body)
        assert got.status_code == 422, got.text
        error = (
            got.json()["error"]["message"] if isinstance(got.json()["error"], dict) else got.json()["error"]
        )
        assert message in error and "inputs" not in error and "truncate" not in error, error


def test_payload_limit_without_content_length_and_openai_error_shape(server):
    client, _ = server
    chunks = (b'{"input": "' + b"w1 " * 5000 + b'"}' for _ in range(3))  # streamed: no Content-Length
    got = client.post("/v1/embeddings", content=chunks, headers={"content-type": "application/json"})
    assert got.status_code == 413
    assert (
        got.json()["error"]["type"] == "validation_error"
        and "over the limit" in got.json()["error"]["message"]
    )
    assert metric(client, "tessera_requests_total", route="/v1/embeddings", outcome="too_large") >= 1


def test_a_full_queue_answers_429_with_retry_after(server):
    client, _ = server
    got = client.post("/embed", json={"inputs": ["w1"] * 32})  # 32 inputs, the queue holds 31
    assert got.status_code == 429 and got.json()["error_type"] == "Overloaded"
    assert int(got.headers["Retry-After"]) >= 1 and float(got.headers["retry-after-ms"]) >= 1
    assert metric(client, "tessera_requests_total", route="/embed", outcome="overloaded") >= 1


def test_overload_status_503_when_configured(model_dir):
    config = ServeConfig(
        model=str(model_dir), port=0, scheduler="fifo_padded", max_queue=2, overload_status=503
    )
    with thread_server(config) as (url, _), httpx.Client(base_url=url) as client:
        got = client.post("/v1/embeddings", json={"input": ["w1", "w2", "w3"]})  # 3 inputs, the queue holds 2
        assert got.status_code == 503 and got.json()["error"]["type"] == "overloaded_error"
        assert int(got.headers["Retry-After"]) >= 1 and float(got.headers["retry-after-ms"]) >= 1
        assert metric(client, "tessera_requests_total", route="/v1/embeddings", outcome="overloaded") == 1
        assert client.post("/v1/embeddings", json={"input": ["w1", "w2"]}).status_code == 200


def test_predict_on_a_classifier(tmp_path):
    spec = EncoderSpec(
        family="roberta", layers=2, hidden=32, heads=4, vocab_size=300, max_length=64, num_labels=3
    )
    folder = build_encoder(tmp_path / "clf", spec)
    served = load_model(folder)
    texts = [text(10, seed=4), text(30, seed=5)]
    logits = reference_outputs(served, served.tokenizer(texts)["input_ids"])
    with (
        thread_server(ServeConfig(model=str(folder), port=0)) as (url, _),
        httpx.Client(base_url=url) as client,
    ):
        assert client.get("/info").json()["model_type"]["classifier"]["id2label"] == {
            "0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"
        }  # fmt: skip
        batch = client.post("/predict", json={"inputs": texts}).json()
        for row, probs in zip(batch, torch.softmax(logits, -1), strict=True):
            assert [p["score"] for p in row] == sorted((p["score"] for p in row), reverse=True)
            got = {p["label"]: p["score"] for p in row}
            # fp32 logits of the served batch against one input alone: the order of sums only
            # (see test_unpadded.py for why 1e-5); the softmax keeps probabilities within it
            assert [got[f"LABEL_{i}"] for i in range(3)] == pytest.approx(probs.tolist(), abs=1e-5)
        raw = client.post("/predict", json={"inputs": texts[0], "raw_scores": True}).json()
        assert {p["label"]: p["score"] for p in raw}["LABEL_2"] == pytest.approx(  # as above: 1e-5
            logits[0, 2].item(), abs=1e-5
        )
        wrong = client.post("/embed", json={"inputs": "w1"})
        assert wrong.status_code == 422 and "use /predict" in wrong.json()["error"]


def test_a_client_that_leaves_is_dropped_before_compute(slow_dir):
    """One input at a time (max batch 1), so a busy engine leaves a late input waiting;
    its client disconnects; it is taken off the queue and never computed."""
    import threading
    import time

    config = ServeConfig(model=str(slow_dir), port=0, max_batch_size=1, scheduler="fifo_padded")
    with thread_server(config) as (url, service), httpx.Client(base_url=url, timeout=60) as client:
        engine = service.backend.engine
        busy = threading.Thread(target=lambda: client.post("/embed", json={"inputs": [text(250)] * 31}))
        busy.start()
        while engine.counts["accepted"] < 31:
            time.sleep(0.001)
        body = json.dumps({"inputs": [text(250, seed=9)]}).encode()
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            while engine.counts["accepted"] < 32:
                time.sleep(0.001)
            assert engine.counts["completed"] < 31  # still busy: the late input waits
        busy.join(60)
        assert engine.counts["cancelled"] == 1 and engine.counts["completed"] == 31
        assert metric(client, "tessera_cancelled_inputs_total") == 1
        assert metric(client, "tessera_requests_total", route="/embed", outcome="cancelled") == 1


def test_workers_flag(capsys):
    from tessera.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--model", "m"]).workers == "auto"
    assert parser.parse_args(["serve", "--model", "m", "--workers", "auto"]).workers == "auto"
    assert parser.parse_args(["serve", "--model", "m", "--workers", "3"]).workers == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--workers", "0"])
    assert "expected a positive integer, got 0" in capsys.readouterr().err
