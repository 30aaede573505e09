"""Schedulers and runners by the names `tessera serve` takes (``--scheduler``, ``--runner``)."""

from __future__ import annotations

from tessera.serve.dp_scheduler import DPScheduler
from tessera.serve.model import ServedModel
from tessera.serve.runner import PaddedRunner, Runner
from tessera.serve.scheduler import BASELINES, DP, NAMES, BatchLimits, Scheduler
from tessera.serve.unpadded import UnpaddedRunner


def make_scheduler(name: str, limits: BatchLimits, cost=None) -> Scheduler:
    """A scheduler by name; ``dp`` needs the measured ``cost`` table."""
    if name == DP:
        if cost is None:
            raise ValueError(f"scheduler {DP!r} needs a cost table (measure one with CostTable.measure)")
        return DPScheduler(limits, cost)
    known = {cls.name: cls for cls in BASELINES}
    if name not in known:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(NAMES)}")
    return known[name](limits)


def make_runner(name: str, served: ServedModel, **options) -> Runner:
    if name == "padded":
        return PaddedRunner(served)
    if name == "unpadded":
        return UnpaddedRunner(served, **options)
    raise ValueError(f"unknown runner {name!r}; choose padded or unpadded")
