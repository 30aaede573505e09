"""Variable-length serving (TurboTransformers, Fang et al. PPoPP 2021): a bounded queue,
batch schedulers (the DP over the length-sorted queue and the baselines it is measured
against), the unpadded runner, the length-aware memory plan, and the HTTP server
(`tessera serve`). The engine and schedulers import no model code; runners and the server
live in their own modules."""

from tessera.serve.choices import make_scheduler
from tessera.serve.cost import CostTable
from tessera.serve.dp_scheduler import DPScheduler, plan_batches
from tessera.serve.engine import Engine
from tessera.serve.request import DrainingError, QueueFullError, Request
from tessera.serve.scheduler import BatchLimits, FifoPadded, OneByOne, Scheduler, SortWindow

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
]
