"""Variable-length serving (TurboTransformers, Fang et al. PPoPP 2021): a bounded queue,
batch schedulers (the DP over the length-sorted queue and the baselines it is measured
against), the unpadded runner, the length-aware memory plan, and the HTTP server
(`tessera serve`). The engine and schedulers import no model code; runners and the server
live in their own modules.

The names load on first use (PEP 562), so `tessera serve --help` does not import torch or
transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.runtime.lazy import lazy_names

_WHERE = {
    "make_scheduler": "tessera.serve.choices",
    "CostTable": "tessera.serve.cost",
    "DPScheduler": "tessera.serve.dp_scheduler",
    "plan_batches": "tessera.serve.dp_scheduler",
    "Engine": "tessera.serve.engine",
    "DrainingError": "tessera.serve.request",
    "QueueFullError": "tessera.serve.request",
    "Request": "tessera.serve.request",
    "BatchLimits": "tessera.serve.scheduler",
    "FifoPadded": "tessera.serve.scheduler",
    "OneByOne": "tessera.serve.scheduler",
    "Scheduler": "tessera.serve.scheduler",
    "SortWindow": "tessera.serve.scheduler",
    "save_example_encoder": "tessera.serve.synthetic",
}

__all__ = [
    "BatchLimits",
    "CostTable",
    "DPScheduler",
    "DrainingError",
    "Engine",
    "FifoPadded",
    "OneByOne",
    "QueueFullError",
    "Request",
    "Scheduler",
    "SortWindow",
    "make_scheduler",
    "plan_batches",
    "save_example_encoder",
]


__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)


if TYPE_CHECKING:  # for type checkers and editors: the same names, eagerly
    from tessera.serve.choices import make_scheduler
    from tessera.serve.cost import CostTable
    from tessera.serve.dp_scheduler import DPScheduler, plan_batches
    from tessera.serve.engine import Engine
    from tessera.serve.request import DrainingError, QueueFullError, Request
    from tessera.serve.scheduler import BatchLimits, FifoPadded, OneByOne, Scheduler, SortWindow
    from tessera.serve.synthetic import save_example_encoder
