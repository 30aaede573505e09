"""`tessera serve --task generate`: the real command on a free loopback port, a group of 2
ranks (PipeFusion 2 stages, 2 patches, 1 warm-up step) serving a tiny class-conditional
Tessera DiT (random weights), shared by every check here; the last test drains it with
SIGTERM.

Pixels are compared to `tessera generate`'s under the same layout, and a batch's to each
request's alone, within one uint8 level: the same computation, where float32 rounding (a
different batch size) can move a pixel across a uint8 boundary, no more."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from live import cli_server, metric
from PIL import Image

from tessera import cli

STEPS = 4
LAYOUT = ["--nproc", "2", "--pipefusion", "2", "--patches", "2", "--warmup-steps", "1"]
LONG = 5000  # steps of a request that runs until cancelled, timed out or failed (~10 ms a step)
MAX_QUEUE = 4


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory):
    from tessera.models.dit import DiT, DiTConfig
    from tessera.train.checkpoint import save_checkpoint

    torch.manual_seed(0)
    # 12 classes: not the digits shape, so `tessera generate` skips its digit classifier
    model = DiT(DiTConfig(hidden_size=32, depth=2, num_heads=2, num_classes=12))
    return save_checkpoint(tmp_path_factory.mktemp("dit") / "dit", config={"model": model.config.to_dict()},
                           weights=model.state_dict())  # fmt: skip


@pytest.fixture(scope="module")
def server(dit_dir):
    args = ["--task", "generate", "--model", str(dit_dir), *LAYOUT,
            "--max-queue", str(MAX_QUEUE), "--max-steps", str(LONG), "--max-images", "4",
            "--max-batch-images", "8", "--request-timeout", "120", "--drain-timeout", "60"]  # fmt: skip
    with cli_server(*args, timeout=180) as (url, proc):
        with httpx.Client(base_url=url, timeout=120) as client:
            yield url, client, proc


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))), dtype=np.int16)


def generate_pngs(dit_dir, tmp_path, digit: int, count: int, seed: int) -> list[np.ndarray]:
    """`tessera generate`'s samples, cut out of its grid (one column, 8x nearest scale, 1-px pad)."""
    out = tmp_path / f"ref-{digit}-{count}-{seed}.png"
    argv = ["generate", "--model", str(dit_dir), "--digits", str(digit), "--per-digit", str(count),
            "--steps", str(STEPS), "--seed", str(seed), "--out", str(out), *LAYOUT]  # fmt: skip
    assert cli.main(argv) == 0
    grid = np.asarray(Image.open(out), dtype=np.int16)[::8, ::8]
    return [grid[1 + r * 9 : 9 + r * 9, 1:9] for r in range(count)]


def wait_for(check, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def running_job(client, **body) -> int:
    job = client.post("/jobs", json={"labels": [1], "steps": LONG, "seed": 0, **body})
    assert job.status_code == 202, job.text
    jid = job.json()["id"]
    wait_for(lambda: client.get(f"/jobs/{jid}").json()["step"] >= 1, "the job to run")
    return jid


def test_openai_client_gets_tessera_generates_images(server, dit_dir, tmp_path):
    import openai

    from tessera.serve.commands import _is_generation_model

    assert _is_generation_model(str(dit_dir))  # --task auto would serve it with generate too
    url, client, _ = server
    info = client.get("/info").json()
    assert (info["layout"], info["ranks"], info["sizes"], info["kind"]) == (
        "pipefusion=2 (patches=2, warmup_steps=1)",
        2,
        ["8x8"],
        "class",
    )
    assert client.get("/health").json()["status"] == "ok"
    assert "/v1/images/generations" in client.get("/openapi.json").json()["paths"]
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    answer = api.images.generate(prompt="3", n=2, size="8x8", response_format="b64_json",
                                 extra_body={"seed": 5, "steps": STEPS})  # fmt: skip
    served = [pixels(d.b64_json) for d in answer.data]
    reference = generate_pngs(dit_dir, tmp_path, 3, 2, 5)
    for got, want in zip(served, reference, strict=True):
        assert abs(got - want).max() <= 1
    assert (
        metric(client, "tessera_generate_requests_total", route="/v1/images/generations", outcome="ok") == 1
    )
    assert metric(client, "tessera_generate_images_total") >= 2
    assert metric(client, "tessera_generate_step_seconds_count") >= STEPS


BAD = [
    ("/v1/images/generations", {"prompt": "3", "size": "9x9"}, "size", "9x9"),
    ("/v1/images/generations", {"prompt": "3", "steps": 0}, "steps", "got 0"),
    ("/v1/images/generations", {"prompt": "3", "steps": LONG + 1}, "steps", f"1..{LONG}"),
    ("/v1/images/generations", {"prompt": "3", "n": 5}, "n", "1..4"),
    ("/v1/images/generations", {"prompt": "3", "response_format": "url"}, "response_format", "b64_json"),
    ("/v1/images/generations", {"prompt": "x" * 2001}, "prompt", "2001 characters"),
    ("/v1/images/generations", {"prompt": "cat"}, "prompt", "class number 0..11"),
    ("/v1/images/generations", {"n": 1}, "prompt", "Field required"),
    ("/v1/images/generations", {"prompt": "3", "colour": "red"}, "colour", "Extra inputs"),
    ("/generate", {"labels": [3, 12]}, "labels", "0..11"),
    ("/generate", {"labels": [3], "height": 16}, "height", "not served"),
    ("/generate", {"labels": [3], "guidance": -1}, "guidance", "0..100"),
    ("/generate", {"labels": [3], "timeout_s": 1e6}, "timeout_s", "(0, 120]"),
    ("/jobs", {"labels": [3], "seed": -2}, "seed", "got -2"),
]


def test_bad_input_is_a_4xx_naming_the_field(server):
    _, client, _ = server
    for route, body, field, words in BAD:
        r = client.post(route, json=body)
        error = r.json()["error"]
        assert r.status_code == 422 and field in error["message"] and words in error["message"], (
            body,
            r.text,
        )
    r = client.post(
        "/v1/images/generations", content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and "not valid JSON" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200  # nothing reached the group


def test_progress_cancel_batching_queue_timeout_and_disconnect(server):
    """One long job holds the group: its progress is polled; requests queue behind it (a
    full queue is 429), a client that leaves is dropped; DELETE stops the job at a step
    boundary (PipeFusion's latents in flight are drained: the next batches would read them
    otherwise), the queued requests of one shape run as one batch, each image equal to its
    request run alone; a request past its timeout is a 504 and frees the group."""
    url, client, _ = server
    jid = running_job(client)
    first = client.get(f"/jobs/{jid}").json()
    assert first["status"] == "running" and 1 <= first["step"] < LONG
    wait_for(lambda: client.get(f"/jobs/{jid}").json()["step"] > first["step"], "progress")
    # a client that disconnects while queued is dropped
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/generate", json={"labels": [9], "steps": STEPS}, timeout=1.0)
    wait_for(lambda: metric(client, "tessera_generate_requests_total", route="/generate", outcome="cancelled") == 1,
             "the dropped request")  # fmt: skip
    bodies = [{"labels": [2], "seed": 10}, {"labels": [4, 5], "seed": 11}, {"labels": [6], "seed": 12}]
    pool = concurrent.futures.ThreadPoolExecutor(len(bodies))
    batched = [pool.submit(client.post, "/generate", json={"steps": STEPS, **b}) for b in bodies]
    wait_for(lambda: metric(client, "tessera_generate_queue_size") == len(bodies), "the requests to queue")
    filler = client.post("/jobs", json={"labels": [0], "steps": 3})  # the queue's last place
    assert filler.status_code == 202
    full = client.post("/generate", json={"labels": [1], "steps": STEPS})
    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1, full.text
    assert client.delete(f"/jobs/{filler.json()['id']}").json()["status"] == "cancelled"
    cancelled = client.delete(f"/jobs/{jid}").json()
    assert cancelled["status"] == "cancelled"
    together = [f.result(timeout=120) for f in batched]
    assert all(r.status_code == 200 for r in together), [r.text for r in together]
    assert [r.json()["batch_images"] for r in together] == [4, 4, 4]
    stopped = client.get(f"/jobs/{jid}").json()
    assert stopped["status"] == "cancelled" and stopped["step"] < LONG
    for body, answer in zip(bodies, together, strict=True):
        alone = client.post("/generate", json={"steps": STEPS, **body}).json()
        assert alone["batch_images"] == len(body["labels"])
        for a, b in zip(answer.json()["images"], alone["images"], strict=True):
            assert abs(pixels(a) - pixels(b)).max() <= 1
    late = client.post("/generate", json={"labels": [1], "steps": LONG, "timeout_s": 0.5})
    assert late.status_code == 504 and "timed out after 0.5 s" in late.json()["error"]["message"], late.text
    assert client.post("/generate", json={"labels": [1], "steps": STEPS}).status_code == 200
    assert client.get("/health").json()["restarts"] == 0  # every stop was clean: no group was replaced


def in_thread(client, body) -> tuple[threading.Thread, dict]:
    """POST /generate from a thread; the answer lands in the dict once the thread ends."""
    answer: dict = {}
    thread = threading.Thread(
        target=lambda: answer.update(r=client.post("/generate", json=body)), daemon=True
    )
    thread.start()
    return thread, answer


def running_step(client) -> int:
    """The step the running request has begun (-1: none running)."""
    return max((j["step"] for j in client.get("/jobs").json() if j["status"] == "running"), default=-1)


def test_a_killed_rank_fails_its_request_naming_it_then_the_group_restarts(server):
    _, client, _ = server
    before = client.post("/generate", json={"labels": [7], "steps": STEPS, "seed": 1}).json()
    pids = client.get("/info").json()["pids"]
    thread, answer = in_thread(client, {"labels": [1], "steps": LONG})
    wait_for(lambda: running_step(client) >= 1, "the request to run")
    os.kill(pids[1], signal.SIGKILL)
    thread.join(120)
    failed = answer["r"]
    assert failed.status_code == 500, failed.text
    message = failed.json()["error"]["message"]
    assert "rank 1 failed" in message and "killed by signal 9" in message, message
    health = wait_for(
        lambda: (h := client.get("/health")).status_code == 200 and h.json(), "the restart", 120
    )
    assert health["restarts"] == 1 and "rank 1" in health["last_failure"]
    assert client.get("/info").json()["pids"] != pids
    again = client.post("/generate", json={"labels": [7], "steps": STEPS, "seed": 1}).json()
    assert again["images"] == before["images"]  # reloaded weights, same image
    assert metric(client, "tessera_generate_group_failures_total") == 1


def test_sigterm_drains_then_exits(server):
    """Last: it ends the shared server."""
    _, client, proc = server
    thread, answer = in_thread(client, {"labels": [1], "steps": 150})
    wait_for(lambda: running_step(client) >= 1, "the request to run")
    proc.send_signal(signal.SIGTERM)
    refused = wait_for(lambda: (r := client.post("/generate", json={"labels": [1], "steps": 2})).status_code == 503
                       and r, "the drain")  # fmt: skip
    assert "draining" in refused.json()["error"]["message"]
    thread.join(120)
    assert answer["r"].status_code == 200  # accepted before the signal: finished
    assert proc.wait(60) == 0
