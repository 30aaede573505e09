"""Error bodies in each API's own shape, the payload limit, and validation messages that
name the offending field.

TEI routes answer ``{"error": ..., "error_type": ...}``; OpenAI routes answer
``{"error": {"message", "type", "param", "code"}}``. The payload limit is a plain ASGI
middleware that reads the body before the app does (so a chunked body without a
Content-Length is measured too) and replays it; after the body, ``receive`` is the
server's own again, which is how a route learns that its client disconnected.
"""

from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse

ERROR_TYPES = {413: "Validation", 422: "Validation", 429: "Overloaded", 503: "Unhealthy", 500: "Backend"}


def error_response(
    path: str, status: int, message: str, headers: dict | None = None, kind: str | None = None
) -> JSONResponse:
    kind = kind or ERROR_TYPES.get(status, "Backend")  # a full queue is Overloaded at 429 or 503
    if path.startswith("/v1/"):
        body = {"error": {"message": message, "type": kind.lower() + "_error", "param": None, "code": status}}
    else:
        body = {"error": message, "error_type": kind}
    return JSONResponse(body, status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"body is not valid JSON ({detail})" if detail else "body is not valid JSON")
            continue
        where = ".".join(loc) or "body"
        given = err.get("input")
        shown = "" if err.get("type") == "missing" else f" (got {json.dumps(given, default=str)[:60]})"
        parts.append(f"{where}: {err.get('msg')}{shown}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request body"


class PayloadLimit:
    """413 for a body over ``limit`` bytes, by its Content-Length or by counting."""

    def __init__(self, app, limit: int, on_refuse=None):
        self.app, self.limit, self.on_refuse = app, limit, on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, send, int(declared))
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([], message, receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, send, size)
            more = message.get("more_body", False)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await self.app(scope, _replay([body], None, receive), send)

    async def _refuse(self, scope, send, size: int):
        message = f"payload of {size} bytes is over the limit of {self.limit} bytes"
        if self.on_refuse:
            self.on_refuse(scope.get("path", ""))
        response = error_response(scope.get("path", ""), 413, message)
        return await response({"type": "http"}, _never, send)


def _replay(messages: list, final, receive):
    pending = list(messages) + ([final] if final else [])

    async def replayed():
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


async def _never():
    return {"type": "http.disconnect"}
