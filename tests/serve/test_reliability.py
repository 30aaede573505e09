"""Under a bounded concurrent load no accepted request is lost or answered twice (every
200 carries the right embeddings, the engine computed exactly the accepted inputs, the
counters agree with what the clients saw); SIGTERM drains the CLI server (accepted
requests finish, new ones get 503, the process exits 0)."""

import asyncio
import random
import signal
import threading
import time

import httpx
import torch
import torch.nn.functional as F
from live import ATOL, cli_server, metric, text, thread_server

from tessera.serve.model import reference_outputs
from tessera.serve.server import ServeConfig


async def load(url: str, calls: list[list[str]], concurrency: int) -> list[httpx.Response]:
    pending = list(enumerate(calls))
    answers: dict[int, httpx.Response] = {}

    async def worker(client):
        while pending:
            i, texts = pending.pop()
            assert i not in answers
            answers[i] = await client.post("/embed", json={"inputs": texts})

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return [answers[i] for i in range(len(calls))]


def test_bounded_load_loses_nothing_and_answers_nothing_twice(model_dir):
    rng = random.Random(0)
    calls = [
        [text(rng.randint(5, 200), seed=1000 * c + k) for k in range(rng.randint(1, 4))] for c in range(120)
    ]
    config = ServeConfig(model=str(model_dir), port=0, max_queue=12, max_batch_size=8)
    with thread_server(config) as (url, service):
        began = time.monotonic()
        answers = asyncio.run(load(url, calls, concurrency=24))
        seconds = time.monotonic() - began
        engine = service.backend.engine
        assert engine.wait_idle(10)
        ok = [i for i, a in enumerate(answers) if a.status_code == 200]
        refused = [i for i, a in enumerate(answers) if a.status_code == 429]
        assert len(ok) + len(refused) == len(calls), {a.status_code for a in answers}
        assert ok and refused  # the load both fit and overflowed the queue of 12
        served_inputs = sum(len(calls[i]) for i in ok)
        assert engine.counts["accepted"] == engine.counts["completed"] == served_inputs
        assert engine.counts["rejected"] == sum(len(calls[i]) for i in refused)
        assert engine.counts["cancelled"] == engine.counts["failed"] == 0
        with httpx.Client(base_url=url) as client:
            assert metric(client, "tessera_requests_total", route="/embed", outcome="ok") == len(ok)
            assert metric(client, "tessera_requests_total", route="/embed", outcome="overloaded") == len(
                refused
            )
            assert metric(client, "tessera_inputs_total") == served_inputs
        for i in ok:  # each answer is its own request's, in its order
            ids = service.served.tokenizer(calls[i])["input_ids"]
            want = F.normalize(reference_outputs(service.served, ids), dim=-1)
            torch.testing.assert_close(torch.tensor(answers[i].json()), want, atol=ATOL, rtol=ATOL)
    print(f"{len(calls)} calls in {seconds:.1f} s: {len(ok)} served, {len(refused)} refused (429)")


def test_sigterm_drains_then_exits(slow_dir):
    args = ["--model", str(slow_dir), "--max-batch-size", "1", "--scheduler", "fifo_padded"]
    with cli_server(*args) as (url, proc), httpx.Client(base_url=url, timeout=60) as client:
        results = []

        def busy(seed):
            results.append(client.post("/embed", json={"inputs": [text(250, seed=seed)] * 31}))

        threads = [threading.Thread(target=busy, args=(s,)) for s in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30  # a hang guard, not a timing check: 30 s is ample
        while metric(client, "tessera_queue_size") < 40:  # both calls accepted, most inputs waiting
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        while client.get("/health").status_code != 503:  # the signal has been handled
            assert time.monotonic() < deadline
            time.sleep(0.005)
        late = client.post("/embed", json={"inputs": "w1 w2"})
        assert late.status_code == 503 and "draining" in late.json()["error"]
        for t in threads:
            t.join(60)
        assert [r.status_code for r in results] == [200, 200]
        assert all(len(r.json()) == 31 for r in results)
        assert proc.wait(30) == 0
        assert any("draining" in line for line in proc.output)
