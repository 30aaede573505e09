"""The HTTP API (FastAPI): text-embeddings-inference's ``POST /embed``, ``POST /predict``,
``GET /info``, ``GET /health``, ``GET /metrics``, and OpenAI's ``POST /v1/embeddings``;
OpenAPI docs at ``/docs`` and ``/openapi.json``.

Outcomes, each counted in ``tessera_requests_total{route, outcome}``: a full queue is 429
(or the configured 503) with ``Retry-After`` (seconds) and ``retry-after-ms``; draining is
503; inputs the model cannot take are 422 naming the input (unless ``truncate``: then they
are cut and ``x-truncated-inputs`` lists them); a body over the payload limit is 413; bad
JSON or a wrong field is 422 naming it; a caller that disconnects is dropped before its
inputs are computed.
"""

from __future__ import annotations

import base64
import math
import time

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse, Response

from tessera.serve.http_errors import PayloadLimit, error_response, validation_message
from tessera.serve.metrics import CONTENT_TYPE
from tessera.serve.request import DrainingError, QueueFullError
from tessera.serve.schemas import (
    EmbedRequest,
    ErrorResponse,
    OpenAIEmbeddingRequest,
    OpenAIEmbeddingResponse,
    Prediction,
    PredictRequest,
)
from tessera.serve.service import ClientGone, InputError, Service, Timings

ROUTES = ("/embed", "/predict", "/v1/embeddings")
_ERRORS = {code: {"model": ErrorResponse} for code in (413, 422, 429, 503)}


def create_app(service: Service, *, payload_limit: int = 2_000_000, overload_status: int = 429) -> FastAPI:
    if overload_status not in (429, 503):
        raise ValueError(f"overload_status must be 429 or 503, got {overload_status}")
    app = FastAPI(
        title="Tessera serve",
        description="Embeddings and sequence classification for transformers encoders, batched by "
        "TurboTransformers' DP scheduler and run unpadded. TEI- and OpenAI-compatible.",
        version=service.info()["version"],
    )
    metrics = service.metrics
    app.add_middleware(PayloadLimit, limit=payload_limit, on_refuse=lambda p: _count(metrics, p, "too_large"))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        _count(metrics, request.url.path, "validation")
        return error_response(request.url.path, 422, validation_message(exc))

    async def serve(route: str, request: Request, compute) -> Response:
        began, timings = time.perf_counter(), Timings()
        if service.draining:
            return _fail(metrics, route, "draining", 503, "the server is draining: no new requests")
        try:
            payload = await compute(timings, lambda: _gone(request))
        except InputError as exc:
            return _fail(metrics, route, "validation", 422, str(exc))
        except QueueFullError as exc:
            wait = exc.retry_after_s
            headers = {
                "Retry-After": str(max(1, math.ceil(wait))),
                "retry-after-ms": str(max(1, round(wait * 1000))),
            }
            return _fail(metrics, route, "overloaded", overload_status, str(exc), headers)
        except DrainingError as exc:
            return _fail(metrics, route, "draining", 503, str(exc))
        except ClientGone:
            _count(metrics, route, "cancelled")
            return Response(status_code=499)  # nobody reads it: the connection is closed
        except Exception as exc:  # a failed batch: the caller learns, the server goes on
            return _fail(metrics, route, "error", 500, f"inference failed: {type(exc).__name__}: {exc}")
        total = time.perf_counter() - began
        metrics.request_seconds.observe(total)
        _count(metrics, route, "ok")
        return JSONResponse(payload, headers=_timing_headers(timings, total))

    @app.post("/embed", response_model=list[list[float]], responses=_ERRORS, summary="Embed texts (TEI)")
    async def embed(body: EmbedRequest, request: Request):
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs

        async def compute(timings, gone):
            ids = service.tokenize(texts, truncate=body.truncate, direction=body.truncation_direction.lower(),
                                   timings=timings)  # fmt: skip
            service.require("embed")
            rows = await service.run(ids, gone, timings)
            return service.embeddings(rows, normalize=body.normalize).tolist()

        return await serve("/embed", request, compute)

    @app.post("/predict", response_model=list[Prediction] | list[list[Prediction]], responses=_ERRORS,
              summary="Classify texts (TEI)")  # fmt: skip
    async def predict(body: PredictRequest, request: Request):
        single = isinstance(body.inputs, str)
        texts = [body.inputs] if single else body.inputs

        async def compute(timings, gone):
            service.require("classify")
            ids = service.tokenize(texts, truncate=body.truncate, direction=body.truncation_direction.lower(),
                                   timings=timings)  # fmt: skip
            scores = service.scores(await service.run(ids, gone, timings), raw=body.raw_scores)
            return scores[0] if single else scores

        return await serve("/predict", request, compute)

    @app.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, responses=_ERRORS,
              summary="Embed texts or token ids (OpenAI)")  # fmt: skip
    async def openai_embeddings(body: OpenAIEmbeddingRequest, request: Request):
        async def compute(timings, gone):
            service.require("embed")
            width = service.served.output_dim
            if body.dimensions is not None and not 1 <= body.dimensions <= width:
                raise InputError(f"dimensions must be between 1 and {width}, got {body.dimensions}")
            given = body.input
            if isinstance(given, str) or (given and all(isinstance(x, str) for x in given)):
                texts = [given] if isinstance(given, str) else given
                ids = service.tokenize(
                    texts, truncate=False, direction="right", timings=timings, field="input"
                )
            else:
                ids = service.check_ids(
                    [given] if given and isinstance(given[0], int) else list(given), "input"
                )
            rows = service.embeddings(await service.run(ids, gone, timings), normalize=True,
                                      dimensions=body.dimensions)  # fmt: skip
            data = [{"object": "embedding", "embedding": _encode(row, body.encoding_format), "index": i}
                    for i, row in enumerate(rows)]  # fmt: skip
            usage = {"prompt_tokens": timings.tokens, "total_tokens": timings.tokens}
            return {
                "object": "list",
                "data": data,
                "model": body.model or service.served.name,
                "usage": usage,
            }

        return await serve("/v1/embeddings", request, compute)

    @app.get("/info", summary="What is served and how (TEI)")
    async def info():
        return service.info()

    @app.get("/health", summary="200 while serving, 503 while draining (TEI)")
    async def health():
        if service.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics_route():
        metrics.queue_size.set(service.backend.queue_size())
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _gone(request: Request) -> None:
    """Returns when the client disconnects (the body is read; receive waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _count(metrics, route: str, outcome: str) -> None:
    if route in ROUTES:
        metrics.requests.labels(route, outcome).inc()


def _fail(metrics, route, outcome, status, message, headers=None) -> Response:
    _count(metrics, route, outcome)
    return error_response(route, status, message, headers, "Overloaded" if outcome == "overloaded" else None)


def _encode(row, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(row.tolist(), dtype="<f4").tobytes()).decode()
    return row.tolist()


def _timing_headers(t: Timings, total: float) -> dict[str, str]:
    ms = lambda s: f"{s * 1000:.3f}"  # noqa: E731
    headers = {
        "x-compute-type": "cpu",
        "x-compute-tokens": str(t.tokens),
        "x-total-time": ms(total),
        "x-tokenization-time": ms(t.tokenization_s),
        "x-queue-time": ms(t.queue_s),
        "x-inference-time": ms(t.inference_s),
    }
    if t.truncated:
        headers["x-truncated-inputs"] = ",".join(map(str, t.truncated))
    return headers
