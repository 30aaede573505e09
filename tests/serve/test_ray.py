"""Ray Serve, on one local Ray instance for the module (starting one costs seconds):

- `tessera serve --ray` runs the same embedding engine in 2 replicas and answers what the
  local server answers;
- `tessera serve --task generate --ray --replicas 2`: two replicas of one rank each, each
  holding its own group with a tiny PixArt pipeline loaded once, behind the same HTTP app; the
  images equal the pipeline's own `tessera generate` run (one process) for the same prompt and
  seed; a rank that raises in a replica is a 500 naming it, and the replica restarts its
  group. Also the pipeline-only refusals (a prompt too long for the text encoder, labels).

Each test deletes its application at the end, so the next starts its own replicas. Skipped,
saying why, when Ray Serve cannot be imported (it is the optional extra `ray`)."""

from __future__ import annotations

import asyncio
import base64
import io
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from live import ATOL, text, thread_server
from PIL import Image

from tessera.serve.server import ServeConfig

try:
    import ray
    from ray import serve
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"Ray Serve is not installed ({exc}); pip install '.[ray]'", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "diffusion"))  # the tiny pipelines' builders
from tiny_pipelines import WORDS, build_pixart_pipeline  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    serve.shutdown()
    ray.shutdown()


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
        serve.delete("tessera")


def pixels(data) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(data))) if isinstance(data, str) else data
    return np.asarray(image, dtype=np.int16)


def references(directory, prompt: str, seeds: list[int]) -> list:
    """The images `tessera generate --model DIR --prompt ... --seed S` makes (one process)."""
    from tessera.diffusion.layout import ParallelConfig
    from tessera.diffusion.pipelines import generate, load_pipeline

    pipe = load_pipeline(directory)
    pipe.set_progress_bar_config(disable=True)
    size = pipe.transformer.config.sample_size * pipe.vae_scale_factor
    return [generate(pipe, prompt=prompt, height=size, width=size, num_steps=STEPS, guidance_scale=2.0,
                     seed=seed, config=ParallelConfig()) for seed in seeds]  # fmt: skip


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))


def test_two_ray_replicas_serve_a_pipeline_as_tessera_generate_does(tmp_path):
    from tessera.serve.generate_ray import start_generate_ray
    from tessera.serve.generate_server import GenerateServeConfig, generate_app, serve_in_thread

    torch.manual_seed(0)
    directory = build_pixart_pipeline(tmp_path / "pixart")
    config = GenerateServeConfig(model=str(directory), nproc=1, port=0)
    try:
        service, metrics = start_generate_ray(config, replicas=2)
        status = serve.status().applications["tessera-generate"].deployments
        assert [d.replica_states.get("RUNNING") for d in status.values()] == [2]
        app = generate_app(config, service, metrics, replicas=2)
        with serve_in_thread(app) as url:
            # two shapes (step counts): two batches, one per replica when both are free
            bodies = [{"prompt": "a red cat", "seed": 4, "steps": STEPS, "n": 2},
                      {"prompt": "a blue house", "seed": 9, "steps": STEPS + 1}]  # fmt: skip
            answers = asyncio.run(post_all(url, bodies))
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
            client = httpx.Client(base_url=url, timeout=60)
            long = client.post("/generate", json={"prompt": " ".join(WORDS * 8)})
            labels = client.post("/generate", json={"prompt": "a cat", "labels": [1]})
            info = client.get("/info").json()
            service.fault_drill = 0  # the next batch's rank 0 raises in its replica
            raised = client.post("/generate", json={"prompt": "a red cat", "steps": STEPS})
            after = client.post("/generate", json={"prompt": "a red cat", "steps": STEPS})
        assert info["replicas"] == 2 and info["kind"] == "text"
        assert long.status_code == 422 and "prompt: " in long.json()["error"]["message"]
        assert "tokens is more than the 120" in long.json()["error"]["message"]
        assert labels.status_code == 422 and labels.json()["error"]["param"] == "labels"
        message = raised.json()["error"]["message"]
        assert raised.status_code == 500 and "rank 0 failed: RuntimeError: fault drill" in message, message
        assert after.status_code == 200, after.text
    finally:
        serve.delete("tessera-generate")
    # image k of a request is `tessera generate --seed seed+k`; exact up to uint8 rounding
    served = answers[0].json()["images"]
    for image, want in zip(served, references(directory, "a red cat", [4, 5]), strict=True):
        assert abs(pixels(image) - pixels(want)).max() <= 1
