"""An HTTP load generator, meant to run in a process of its own: ``python loadgen.py``
reads a job (JSON) on stdin and writes one record per request (JSON) on stdout. It
imports only the standard library and httpx (run by path, not as part of the package, so
it does not pay for torch).

Two modes:

- ``open``: open-loop Poisson arrivals at ``rate`` requests/s: request i is sent at its
  arrival time whether or not earlier ones were answered (so queueing at the server shows
  as latency, as it does for real clients);
- ``closed``: ``concurrency`` clients, each sending its next request when its last one is
  answered (saturation: the server always has work waiting).

A record is ``[index, sent_s, done_s, status, tokens]``, times from the start of the run.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time


async def run_job(job: dict) -> list[list]:
    import httpx

    texts, tokens = job["texts"], job["tokens"]
    records: list[list] = []
    limits = httpx.Limits(max_connections=job.get("max_connections", 4096), max_keepalive_connections=256)
    async with httpx.AsyncClient(
        base_url=job["url"], timeout=job.get("timeout_s", 300), limits=limits
    ) as client:
        began = time.perf_counter()

        async def send(i: int) -> None:
            sent = time.perf_counter() - began
            body = {"input": texts[i], "model": job.get("model", "bench")}
            try:
                response = await client.post(job["path"], json=body)
                status = response.status_code
            except httpx.HTTPError:
                status = -1  # the connection failed: counted as an error, never as served
            records.append([i, sent, time.perf_counter() - began, status, tokens[i]])

        if job["mode"] == "closed":
            queue = list(range(len(texts)))[::-1]

            async def client_loop():
                while queue:
                    await send(queue.pop())

            await asyncio.gather(*(client_loop() for _ in range(job["concurrency"])))
        else:
            rng = random.Random(job.get("seed", 0))
            tasks, at = [], 0.0
            for i in range(len(texts)):
                at += rng.expovariate(job["rate"])
                delay = at - (time.perf_counter() - began)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(i)))
            await asyncio.gather(*tasks)
    return sorted(records)


def main() -> None:
    job = json.load(sys.stdin)
    json.dump(asyncio.run(run_job(job)), sys.stdout)


if __name__ == "__main__":
    main()
