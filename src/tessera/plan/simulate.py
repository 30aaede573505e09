"""A discrete-event simulator of one step: operations on ranks, each on a resource, with the
dependencies the implementation has.

Every rank has four resources, ``compute``, ``send``, ``recv`` (point-to-point links are
full duplex) and ``collective`` (collectives run on their own communicator, as xDiT and
Tessera put PipeFusion's sends and the sequence-parallel collectives on different groups).
Compute and collectives run one at a time in the order they were added (issue order, as a
CUDA stream or one communicator does): a collective holds ``collective`` on every
participant, starts when all of them are free and its dependencies are done, and ends for
all together. A point-to-point transfer holds the sender's ``send`` and the receiver's
``recv`` for its duration, in the earliest gap both have once its dependencies are done
(posted non-blocking sends and receives complete as their data is ready, not in the order
they were posted). Compute and links are separate, so a transfer overlaps compute exactly
where no dependency forbids it: a synchronous collective is written as "the next compute
depends on it", an overlapped one is not waited for until its result is read.

    start(op) = the earliest time >= the end of its dependencies at which every resource it
                uses is free (after the resource's last op, for compute and collectives)
    end(op)   = start(op) + seconds(op)
"""

from __future__ import annotations

from dataclasses import dataclass, field

RESOURCES = ("compute", "link", "p2p")  # link: a collective; p2p: one send


@dataclass(frozen=True)
class Op:
    name: str
    ranks: tuple[int, ...]
    resource: str
    seconds: float
    after: tuple[int, ...]


@dataclass
class Schedule:
    """Operations in issue order. ``add`` returns the op's id for later ``after=``."""

    ranks: int
    ops: list[Op] = field(default_factory=list)

    def add(self, name: str, ranks, resource: str, seconds: float, after=()) -> int:
        ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
        if resource not in RESOURCES:
            raise ValueError(f"resource {resource!r} is not one of {RESOURCES}")
        if resource == "p2p" and (len(ranks) != 2 or ranks[0] == ranks[1]):
            raise ValueError(f"op {name!r}: a send needs two different ranks, got {ranks}")
        if not ranks or min(ranks) < 0 or max(ranks) >= self.ranks:
            raise ValueError(f"op {name!r}: ranks {ranks} outside 0..{self.ranks - 1}")
        if seconds < 0:
            raise ValueError(f"op {name!r}: seconds must be >= 0, got {seconds}")
        deps = tuple(a for a in after if a is not None)
        if any(not 0 <= a < len(self.ops) for a in deps):
            raise ValueError(f"op {name!r}: depends on an op not yet added ({deps})")
        self.ops.append(Op(name, ranks, resource, float(seconds), deps))
        return len(self.ops) - 1

    def compute(self, rank: int, seconds: float, after=(), name: str = "compute") -> int:
        return self.add(name, rank, "compute", seconds, after)

    def transfer(self, ranks, seconds: float, after=(), name: str = "comm") -> int:
        """A collective over ``ranks``."""
        return self.add(name, ranks, "link", seconds, after)

    def p2p(self, src: int, dst: int, seconds: float, after=(), name: str = "send") -> int:
        """``src`` sends to ``dst``."""
        return self.add(name, (src, dst), "p2p", seconds, after)


@dataclass(frozen=True)
class Timeline:
    start: tuple[float, ...]
    end: tuple[float, ...]
    makespan: float
    busy: dict[tuple[int, str], float]  # (rank, compute | send | recv | collective) -> seconds

    def rank_end(self, rank: int, ops: list[Op]) -> float:
        return max((e for op, e in zip(ops, self.end, strict=True) if rank in op.ranks), default=0.0)


def simulate(schedule: Schedule) -> Timeline:
    free: dict[tuple[int, str], float] = {}
    busy: dict[tuple[int, str], float] = {}
    start, end = [], []
    held: dict[tuple[int, str], list[tuple[float, float]]] = {}  # p2p resources' busy intervals
    for op in schedule.ops:
        ready = max((end[a] for a in op.after), default=0.0)
        if op.resource == "p2p":
            keys = [(op.ranks[0], "send"), (op.ranks[1], "recv")]
            t0 = _earliest_gap([held.setdefault(k, []) for k in keys], ready, op.seconds)
            for k in keys:
                held[k].append((t0, t0 + op.seconds))
        else:  # compute, or a collective on its communicator's stream: issue order
            keys = (
                [(op.ranks[0], "compute")]
                if op.resource == "compute"
                else [(r, "collective") for r in op.ranks]
            )
            t0 = max([ready] + [free.get(k, 0.0) for k in keys])
        t1 = t0 + op.seconds
        for k in keys:
            free[k] = max(free.get(k, 0.0), t1)
            busy[k] = busy.get(k, 0.0) + op.seconds
        start.append(t0)
        end.append(t1)
    return Timeline(tuple(start), tuple(end), max(end, default=0.0), busy)


def _earliest_gap(intervals: list[list[tuple[float, float]]], ready: float, seconds: float) -> float:
    """The earliest t >= ready with [t, t + seconds) free in every list of busy intervals."""
    t = ready
    moved = True
    while moved and seconds > 0:
        moved = False
        for busy in intervals:
            for lo, hi in busy:
                if lo < t + seconds and t < hi:
                    t, moved = hi, True
    return t
