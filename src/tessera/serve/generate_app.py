"""The generation server's HTTP API (FastAPI; OpenAPI docs at ``/docs``):

- ``POST /v1/images/generations``: OpenAI's Images API (``prompt``, ``n``, ``size``,
  ``response_format`` ``b64_json``), with ``seed``, ``steps``, ``guidance`` and
  ``negative_prompt`` as extensions (the OpenAI client sends them in ``extra_body``);
- ``POST /generate``: every setting, answered when the images are ready;
- ``POST /jobs``, ``GET /jobs/{id}``, ``DELETE /jobs/{id}``: the same request run in the
  background, its progress (the step reached) polled, its images read when done, or
  cancelled;
- ``GET /health``, ``GET /info``, ``GET /metrics`` (Prometheus).

Outcomes: a setting the model cannot take is 422 naming the field; a full queue 429 with
``Retry-After``; draining or an unhealthy group 503; a request past its timeout 504; a rank
that raised or died 500 naming the rank and its error; a client that disconnects is
dropped (its images are not computed, or its batch is stopped if it was alone in it).
"""

from __future__ import annotations

import asyncio
import base64
import math
import secrets
import time
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response

from tessera.serve.generate_group import GroupError
from tessera.serve.generate_metrics import GenerateMetrics
from tessera.serve.generate_service import (
    GenerateService,
    GenerationRequest,
    RequestCancelled,
    RequestTimeout,
    Settings,
    Unavailable,
)
from tessera.serve.generate_spec import InputError
from tessera.serve.http_errors import PayloadLimit, validation_message
from tessera.serve.metrics import CONTENT_TYPE
from tessera.serve.request import DrainingError, QueueFullError

DEFAULT_STEPS, DEFAULT_GUIDANCE = 20, 2.0  # as `tessera generate`
MAX_SEED = 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpenAIImageRequest(_Strict):
    prompt: str = Field(description="text (a pipeline), or a class number (a class-conditional DiT)")
    model: str | None = None
    n: int = Field(1, description="images to generate")
    size: str | None = Field(None, description='WIDTHxHEIGHT, one of /info\'s sizes ("auto": the default)')
    response_format: Literal["b64_json", "url"] | None = Field("b64_json", description="b64_json only")
    quality: str | None = Field(None, description="accepted for compatibility; ignored")
    style: str | None = Field(None, description="accepted for compatibility; ignored")
    user: str | None = None
    seed: int | None = Field(None, description="extension: the first image's seed (random if absent)")
    steps: int | None = Field(None, description=f"extension: denoising steps (default {DEFAULT_STEPS})")
    guidance: float | None = Field(
        None, description=f"extension: guidance scale (default {DEFAULT_GUIDANCE})"
    )
    negative_prompt: str | None = Field(None, description="extension: negative prompt (pipelines)")


class GenerateBody(_Strict):
    prompt: str | None = Field(
        None, description="text (a pipeline), or a class number (a class-conditional DiT)"
    )
    negative_prompt: str = ""
    labels: list[int] | None = Field(None, description="class-conditional DiT: one image per class listed")
    n: int = Field(1, description="images of the prompt")
    height: int | None = Field(None, description="pixels (default: the model's size)")
    width: int | None = None
    steps: int = DEFAULT_STEPS
    guidance: float = DEFAULT_GUIDANCE
    seed: int | None = Field(None, description="the first image's seed (random if absent); image k uses seed + k"
                                               " for a pipeline, as `tessera generate --seed` draws it")  # fmt: skip
    frames: int | None = Field(None, description="video pipelines: frames (default: the pipeline's)")
    timeout_s: float | None = Field(
        None, description="seconds before the request is given up (server's limit)"
    )


def create_generate_app(service: GenerateService, metrics: GenerateMetrics, *, info: dict,
                        payload_limit: int = 1_000_000) -> FastAPI:  # fmt: skip
    app = FastAPI(
        title="Tessera generate",
        description="Parallel DiT image generation over a group of ranks. OpenAI Images API-compatible.",
        version=info.get("version", "0"),
    )
    app.add_middleware(PayloadLimit, limit=payload_limit, on_refuse=lambda p: _count(metrics, p, "too_large"))
    spec, limits = service.spec, service.limits

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        _count(metrics, request.url.path, "validation")
        field = next((str(p) for e in exc.errors() for p in e.get("loc", ()) if p != "body"), None)
        return _error(request.url.path, 422, validation_message(exc), field)

    def settings(
        prompt, negative_prompt, labels, n, height, width, steps, guidance, seed, frames=None
    ) -> Settings:
        if not 1 <= n <= limits.max_images:
            raise InputError("n", f"must be 1..{limits.max_images}, got {n}")
        if not 1 <= steps <= limits.max_steps:
            raise InputError("steps", f"must be 1..{limits.max_steps}, got {steps}")
        from tessera.diffusion.parallel import check_steps

        try:
            check_steps(service.group.config, steps)
        except ValueError as exc:
            raise InputError("steps", str(exc)) from None
        if not (math.isfinite(guidance) and 0 <= guidance <= 100):
            raise InputError("guidance", f"must be a number in 0..100, got {guidance}")
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise InputError("seed", f"must be 0..{MAX_SEED}, got {seed}")
        seed = secrets.randbelow(2**31) if seed is None else seed
        for name, text in (("prompt", prompt or ""), ("negative_prompt", negative_prompt or "")):
            if len(text) > limits.max_prompt_chars:
                raise InputError(
                    name, f"{len(text)} characters is over the limit of {limits.max_prompt_chars}"
                )
        spec.check_size(height, width)
        common = dict(height=height, width=width, steps=steps, guidance=float(guidance), seed=seed)
        if spec.kind == "class":
            if negative_prompt:
                raise InputError("negative_prompt", "this model is class-conditional and takes no text")
            if labels is not None:
                if prompt is not None or n != 1:
                    raise InputError("labels", "give labels, or a prompt (a class number) with n; not both")
                if not 1 <= len(labels) <= limits.max_images:
                    raise InputError("labels", f"must list 1..{limits.max_images} classes, got {len(labels)}")
                spec.check_labels(labels)
                return Settings(labels=tuple(labels), **common)
            if prompt is None:
                raise InputError("prompt", "give a class number as the prompt, or labels")
            return Settings(labels=(spec.class_of(prompt),) * n, **common)
        if labels is not None:
            raise InputError(
                "labels", "this model is a text-conditioned pipeline: describe the image with prompt"
            )
        if not prompt or not prompt.strip():
            raise InputError("prompt", "must not be empty")
        spec.check_prompt("prompt", prompt)
        spec.check_prompt("negative_prompt", negative_prompt or "")
        frames = spec.check_frames(frames, height, width)
        return Settings(
            prompt=prompt, negative_prompt=negative_prompt or "", count=n, frames=frames, **common
        )

    def native_settings(body: GenerateBody) -> Settings:
        default_h, default_w = spec.default_size
        if spec.kind == "class" and body.frames is not None:
            raise InputError("frames", "this model makes images; frames are for video pipelines")
        return settings(body.prompt, body.negative_prompt, body.labels, body.n, body.height or default_h,
                        body.width or default_w, body.steps, body.guidance, body.seed, body.frames)  # fmt: skip

    def check_timeout(timeout_s: float | None) -> float | None:
        if timeout_s is not None and not 0 < timeout_s <= service.request_timeout_s:
            raise InputError(
                "timeout_s", f"must be in (0, {service.request_timeout_s:g}] seconds, got {timeout_s}"
            )
        return timeout_s

    async def answer(route: str, request: Request, make, shape) -> Response:
        began = time.perf_counter()
        try:
            job = service.submit(*make())
            result = await _wait(service, job, request)
        except Exception as exc:  # noqa: BLE001 - every outcome has its status
            return _failure(metrics, route, exc)
        metrics.request_seconds.observe(time.perf_counter() - began)
        _count(metrics, route, "ok")
        headers = {"x-queue-time": f"{result['queue_s'] * 1000:.1f}", "x-batch-images": str(result["batch_images"]),
                   "x-inference-time": f"{result['inference_s'] * 1000:.1f}", "x-seed": str(job.settings.seed)}  # fmt: skip
        return JSONResponse(shape(job, result), headers=headers)

    @app.post("/v1/images/generations", summary="Generate images (OpenAI Images API)")
    async def openai_images(body: OpenAIImageRequest, request: Request):
        def make():
            if spec.video:
                raise InputError(
                    "model", "this server's model makes videos (animated GIFs): use POST /generate"
                )
            if body.response_format == "url":
                raise InputError("response_format", "only b64_json is served (no image store for urls)")
            height, width = spec.parse_size(body.size)
            steps = DEFAULT_STEPS if body.steps is None else body.steps
            guidance = DEFAULT_GUIDANCE if body.guidance is None else body.guidance
            return settings(body.prompt, body.negative_prompt, None, body.n, height, width, steps, guidance,
                            body.seed), None  # fmt: skip

        def shape(job, result):
            data = [{"b64_json": _b64(png), "revised_prompt": None} for png in result["images"]]
            return {"created": int(time.time()), "data": data}

        return await answer("/v1/images/generations", request, make, shape)

    @app.post("/generate", summary="Generate images with every setting; answered when ready")
    async def generate(body: GenerateBody, request: Request):
        return await answer("/generate", request, lambda: (native_settings(body), check_timeout(body.timeout_s)),
                            lambda job, result: _native(job, result))  # fmt: skip

    @app.post("/jobs", status_code=202, summary="Start a generation in the background; poll /jobs/{id}")
    async def start_job(body: GenerateBody):
        try:
            job = service.submit(native_settings(body), check_timeout(body.timeout_s))
        except Exception as exc:  # noqa: BLE001
            return _failure(metrics, "/jobs", exc)
        _count(metrics, "/jobs", "ok")
        return JSONResponse(service.progress(job), status_code=202)

    @app.get("/jobs", summary="The requests the server remembers (queued, running, recent), oldest first")
    async def list_jobs():
        return [service.progress(job) for job in list(service.jobs.values())]

    @app.get("/jobs/{job_id}", summary="A job's progress (step reached), and its images once done")
    async def job_status(job_id: int):
        job = service.jobs.get(job_id)
        if job is None:
            return _error(
                "/jobs", 404, f"no job {job_id} (finished jobs are kept for a while only)", "job_id"
            )
        body = service.progress(job)
        if job.status == "done":
            body |= _native(job, job.future.result())
        return body

    @app.delete("/jobs/{job_id}", summary="Cancel a job (its batch stops at the next step if alone)")
    async def cancel_job(job_id: int):
        job = service.jobs.get(job_id)
        if job is None:
            return _error("/jobs", 404, f"no job {job_id}", "job_id")
        service.cancel(job, RequestCancelled("cancelled by DELETE"))
        return service.progress(job)

    @app.get("/health", summary="200 while the group serves; 503 starting, restarting, unhealthy or draining")
    async def health():
        state = "draining" if service.draining else service.state
        body = {"status": state, "restarts": service.restarts, "last_failure": service.last_failure}
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    @app.get("/info", summary="Model, layout, ranks and limits")
    async def info_route():
        group = service.group
        return info | {
            "model": spec.name, "kind": spec.kind, "sizes": spec.size_names(), "video": spec.video,
            "default_frames": spec.default_frames or None,
            "num_classes": spec.num_classes or None, "token_limit": spec.token_limit or None,
            "layout": group.config.describe(), "ranks": group.world_size, "pids": group.pids,
            "max_queue": service.max_queue, "max_steps": limits.max_steps, "max_images": limits.max_images,
            "max_batch_images": limits.max_batch_images, "request_timeout_s": service.request_timeout_s,
        }  # fmt: skip

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics_route():
        metrics.queue_size.set(len(service.queue))
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _wait(service: GenerateService, job: GenerationRequest, request: Request) -> dict:
    """The job's result; its client leaving cancels it; past its deadline (plus a margin
    for a group restart in progress) it is timed out here if the service has not already."""
    answer = asyncio.wrap_future(job.future)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        margin = job.deadline - time.monotonic() + 5.0
        done, _ = await asyncio.wait(
            {answer, gone}, timeout=max(margin, 0.1), return_when=asyncio.FIRST_COMPLETED
        )
        if answer not in done:
            if gone in done:
                service.cancel(job, RequestCancelled("the client disconnected"))
            else:
                service.cancel(job, RequestTimeout(f"timed out after {job.timeout_s:g} s"))
        return await answer
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _failure(metrics: GenerateMetrics, route: str, exc: BaseException) -> Response:
    if isinstance(exc, InputError):
        _count(metrics, route, "validation")
        return _error(route, 422, str(exc), exc.field)
    if isinstance(exc, QueueFullError):
        _count(metrics, route, "overloaded")
        wait = exc.retry_after_s
        headers = {
            "Retry-After": str(max(1, math.ceil(wait))),
            "retry-after-ms": str(max(1, round(wait * 1000))),
        }
        return _error(route, 429, str(exc), None, headers)
    if isinstance(exc, DrainingError):
        _count(metrics, route, "draining")
        return _error(route, 503, str(exc))
    if isinstance(exc, Unavailable):
        _count(metrics, route, "unavailable")
        return _error(route, 503, str(exc))
    if isinstance(exc, RequestTimeout):
        _count(metrics, route, "timeout")
        return _error(route, 504, str(exc))
    if isinstance(exc, RequestCancelled):
        _count(metrics, route, "cancelled")
        return _error(route, 499, str(exc))  # nobody reads it when the client left
    _count(metrics, route, "error")
    message = str(exc) if isinstance(exc, GroupError) else f"generation failed: {type(exc).__name__}: {exc}"
    return _error(route, 500, message)


_TYPES = {404: "not_found_error", 422: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled",
          503: "unavailable_error", 504: "timeout_error", 500: "server_error"}  # fmt: skip


def _error(route: str, status: int, message: str, field: str | None = None, headers=None) -> JSONResponse:
    """OpenAI's error shape on every route: {"error": {message, type, param, code}}."""
    body = {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": field,
                      "code": status}}  # fmt: skip
    return JSONResponse(body, status_code=status, headers=headers)


def _count(metrics: GenerateMetrics, route: str, outcome: str) -> None:
    if route.startswith("/jobs"):
        route = "/jobs"
    if route in ("/v1/images/generations", "/generate", "/jobs"):
        metrics.count(route, outcome)


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode()


def _native(job: GenerationRequest, result: dict) -> dict:
    s = job.settings
    return {
        "id": job.id,
        "images": [_b64(data) for data in result["images"]],
        "format": "gif" if s.frames else "png",
        "frames": s.frames or None,
        "seed": s.seed,
        "steps": s.steps,
        "height": s.height,
        "width": s.width,
        "guidance": s.guidance,
        "batch_images": result["batch_images"],
        "queue_s": result["queue_s"],
        "inference_s": result["inference_s"],
    }
