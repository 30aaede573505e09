"""Ray Serve: `tessera serve --ray` runs the same engine in 2 replicas of a local Ray
instance and answers what the local server answers. Skipped, saying why, when Ray Serve
cannot be imported (it is the optional extra `ray`)."""

import asyncio

import httpx
import pytest
import torch
from live import ATOL, text, thread_server

from tessera.serve.server import ServeConfig

try:
    import ray
    from ray import serve
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"Ray Serve is not installed ({exc}); pip install '.[ray]'", allow_module_level=True)


async def embed_all(url, calls):
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        answers = await asyncio.gather(*(client.post("/embed", json={"inputs": c}) for c in calls))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    return [torch.tensor(a.json()) for a in answers]


def test_two_ray_replicas_answer_what_the_local_server_answers(model_dir, tmp_path):
    from tessera.serve.ray_serve import start_ray_service

    calls = [[text(n, seed=n + k) for k in range(3)] for n in (5, 60, 120, 250, 33, 90)]
    config = ServeConfig(model=str(model_dir), port=0, threads=1, cost_table=str(tmp_path / "cost.json"))
    with thread_server(config) as (url, _):  # also measures and saves the cost table the replicas load
        local = asyncio.run(embed_all(url, calls))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        service = start_ray_service(config, replicas=2)
        status = serve.status().applications["tessera"].deployments
        assert [d.replica_states.get("RUNNING") for d in status.values()] == [2]
        with thread_server(config, service) as (url, _):
            remote = asyncio.run(embed_all(url, calls))
            info = httpx.get(url + "/info").json()["tessera"]
        assert info["ray"]["replicas"] == 2
        for a, b in zip(local, remote, strict=True):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=ATOL)  # same engine, same batching rules
    finally:
        serve.shutdown()
        ray.shutdown()
