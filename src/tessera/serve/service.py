"""What the HTTP routes share, free of HTTP: tokenizing with the model's limits, handing
token ids to a backend (the local engine, or Ray replicas) while watching for the caller
leaving, and turning output rows into embeddings or label scores."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tessera.serve.engine import Engine
from tessera.serve.metrics import ServerMetrics
from tessera.serve.model import ServedModel


def _item(field: str, i: int) -> str:
    """Item ``i`` of a request's field as the errors name it: TEI's ``input 1``, OpenAI's ``input[1]``."""
    return f"input {i}" if field == "inputs" else f"{field}[{i}]"


class InputError(ValueError):
    """A request's inputs cannot be served as sent (the HTTP layer answers 422)."""


class ClientGone(Exception):
    """The caller disconnected before its answer was ready."""


@dataclass
class Timings:
    tokenization_s: float = 0.0
    queue_s: float = 0.0
    inference_s: float = 0.0
    tokens: int = 0
    truncated: list[int] = field(default_factory=list)  # indices of inputs cut to max_length


class LocalBackend:
    """The engine in this process. Inputs of one call are queued together; when the
    caller leaves, those still waiting are taken off the queue (never computed)."""

    def __init__(self, engine: Engine, workers_setting: int | str | None = None):
        self.engine = engine
        self.workers_setting = workers_setting  # as configured ("auto" or a count), for /info

    async def infer(
        self, sequences: list[list[int]], gone: Callable[[], Awaitable[None]], timings: Timings
    ) -> list[torch.Tensor]:
        requests = self.engine.submit(sequences)
        answers = asyncio.gather(*(asyncio.wrap_future(r.future) for r in requests))
        watcher = asyncio.ensure_future(gone())
        try:
            done, _ = await asyncio.wait({answers, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if answers not in done:
            self.engine.cancel(requests)
            answers.cancel()
            raise ClientGone
        rows = answers.result()
        timings.queue_s = max(r.queue_seconds() for r in requests)
        timings.inference_s = max(r.finished_at - r.scheduled_at for r in requests)
        return rows

    def queue_size(self) -> int:
        return self.engine.queue_size()

    def begin_drain(self) -> None:
        self.engine.begin_drain()

    def wait_idle(self, timeout: float) -> bool:
        return self.engine.wait_idle(timeout)

    def describe(self) -> dict:
        engine = self.engine
        runners = [getattr(r, "describe", lambda r=r: {"name": type(r).__name__})() for r in engine.runners]
        runner = runners[0]
        for key in ("dense_calls", "dense_rows", "dense_buffers"):  # counted over every worker
            if key in runner:
                runner[key] = sum(r.get(key, 0) for r in runners)
        return {
            "scheduler": engine.scheduler.describe(),
            "runner": runner,
            "max_queue": engine.max_queue,
            "workers": len(engine.runners),
            "workers_setting": self.workers_setting,
            "threads_per_worker": torch.get_num_threads(),
        }


class Service:
    def __init__(self, served: ServedModel, backend, metrics: ServerMetrics, *, max_client_batch: int = 32):
        self.served, self.backend, self.metrics = served, backend, metrics
        self.max_client_batch = max_client_batch
        self.draining = False

    def begin_drain(self) -> None:
        self.draining = True
        self.backend.begin_drain()

    def tokenize(
        self, texts: list[str], *, truncate: bool, direction: str, timings: Timings, field: str = "inputs"
    ) -> list[list[int]]:
        """``field``: the request's field the texts came in (OpenAI's ``input``, TEI's
        ``inputs``), which the errors name."""
        self._check_count(len(texts), field)
        began = time.perf_counter()
        tok, limit = self.served.tokenizer, self.served.max_length
        ids = tok(texts, truncation=False)["input_ids"]
        too_long = [i for i, s in enumerate(ids) if len(s) > limit]
        if too_long and truncate:
            side = tok.truncation_side
            tok.truncation_side = direction  # safe: tokenization runs on the event loop's one thread
            try:
                cut = tok([texts[i] for i in too_long], truncation=True, max_length=limit)["input_ids"]
            finally:
                tok.truncation_side = side
            for i, ids_i in zip(too_long, cut, strict=True):
                ids[i] = ids_i
            timings.truncated = too_long
        timings.tokenization_s = time.perf_counter() - began
        self.metrics.tokenization.observe(timings.tokenization_s)
        self.check_lengths(ids, field)
        return ids

    def check_ids(self, sequences: list[list[int]], field: str = "input") -> list[list[int]]:
        """Token ids sent as they are (OpenAI's token-array ``input``)."""
        self._check_count(len(sequences), field)
        vocab = self.served.config.vocab_size
        for i, ids in enumerate(sequences):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InputError(
                    f"{_item(field, i)}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
                )
        self.check_lengths(sequences, field)
        return sequences

    def check_lengths(self, sequences: list[list[int]], field: str = "inputs") -> None:
        limit = self.served.max_length
        # only TEI's routes have a truncate field (OpenAI's embeddings API has none)
        fix = "shorten it or set truncate to true" if field == "inputs" else "shorten it"
        for i, ids in enumerate(sequences):
            if not ids:
                raise InputError(f"{_item(field, i)} is empty")
            if len(ids) > limit:
                raise InputError(
                    f"{_item(field, i)} has {len(ids)} tokens; the model takes at most {limit}: {fix}"
                )

    def _check_count(self, n: int, field: str = "inputs") -> None:
        if n == 0:
            raise InputError(f"{field} must not be empty")
        if n > self.max_client_batch:
            raise InputError(
                f"{n} items in {field} in one request; at most {self.max_client_batch} (max_client_batch)"
                if field != "inputs"
                else f"{n} inputs in one request; at most {self.max_client_batch} (max_client_batch)"
            )

    async def run(self, sequences, gone, timings: Timings) -> torch.Tensor:
        timings.tokens = sum(len(s) for s in sequences)
        rows = await self.backend.infer(sequences, gone, timings)
        return torch.stack(list(rows))

    def require(self, task: str) -> None:
        if self.served.task != task:
            other = "/predict" if self.served.task == "classify" else "/embed"
            raise InputError(f"{self.served.name} is served for {self.served.task}: use {other}")

    def embeddings(
        self, rows: torch.Tensor, *, normalize: bool, dimensions: int | None = None
    ) -> torch.Tensor:
        if dimensions is not None:
            if not 1 <= dimensions <= rows.shape[1]:
                raise InputError(f"dimensions must be between 1 and {rows.shape[1]}, got {dimensions}")
            rows = rows[:, :dimensions]
        return F.normalize(rows, dim=-1) if normalize else rows

    def scores(self, logits: torch.Tensor, *, raw: bool) -> list[list[dict]]:
        if raw:
            values = logits
        elif self.served.config.problem_type == "multi_label_classification":
            values = torch.sigmoid(logits)
        else:
            values = torch.softmax(logits, dim=-1)
        labels = self.served.id2label
        out = []
        for row in values.tolist():
            pairs = [{"score": s, "label": labels.get(i, str(i))} for i, s in enumerate(row)]
            out.append(sorted(pairs, key=lambda p: -p["score"]))
        return out

    def info(self) -> dict:
        served = self.served
        model_type = (
            {"classifier": {"id2label": {str(k): v for k, v in served.id2label.items()},
                            "label2id": {v: k for k, v in served.id2label.items()}}}
            if served.task == "classify"
            else {"embedding": {"pooling": served.pooling}}
        )  # fmt: skip
        limits = self.backend.describe()["scheduler"]
        return {
            "model_id": served.name,
            "model_sha": None,
            "model_dtype": str(next(served.model.parameters()).dtype).removeprefix("torch."),
            "model_type": model_type,
            "max_concurrent_requests": self.backend.describe()["max_queue"],
            "max_input_length": served.max_length,
            "max_batch_tokens": limits["max_batch_tokens"],
            "max_batch_requests": limits["max_batch_size"],
            "max_client_batch_size": self.max_client_batch,
            "tokenization_workers": 1,
            "version": _version(),
            "tessera": {"family": served.family.model_type, **self.backend.describe()},
        }


def _version() -> str:
    from tessera import __version__

    return __version__
