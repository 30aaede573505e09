"""What ``tessera.runtime.comm`` counts and emulates: the ``Ledger`` of bytes, calls and
emulated seconds per (operation, mesh axis), the clock of an emulated link, and the work
objects an asynchronous call returns (their ``wait`` finishes the emulated wait or counts the
seconds the caller was blocked)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tessera.runtime.link import Link


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Ledger:
    """Bytes and call counts per (operation, axis)."""

    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    emulated: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    # the flat all-gathers and reduce-scatters (ZeRO's): the link time of every call issued
    # (with a link model) and the seconds the caller was blocked by them (in a synchronous call,
    # or in an asynchronous one's wait): link time not blocked on was hidden behind compute
    link_s: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    blocked_s: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))

    def record(self, op: str, axis: str, num_bytes: int) -> None:
        self.bytes[(op, axis)] += num_bytes
        self.calls[(op, axis)] += 1

    def emulated_seconds(self) -> float:
        """Seconds this rank spent waiting for emulated link time (0 without a link model)."""
        return sum(self.emulated.values())

    def total(self, *, op: str | None = None, axis: str | None = None) -> int:
        return sum(
            b for (o, a), b in self.bytes.items() if (op is None or o == op) and (axis is None or a == axis)
        )

    def count(self, *, op: str | None = None, axis: str | None = None) -> int:
        return sum(
            c for (o, a), c in self.calls.items() if (op is None or o == op) and (axis is None or a == axis)
        )

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{"op@axis": {"bytes": ..., "calls": ...}}, JSON-ready; with a link model also
        "emulated_s", the seconds waited for it."""
        out: dict[str, dict[str, float]] = {}
        for o, a in sorted(self.bytes):
            out[f"{o}@{a}"] = {"bytes": self.bytes[(o, a)], "calls": self.calls[(o, a)]}
            if (o, a) in self.emulated:
                out[f"{o}@{a}"]["emulated_s"] = self.emulated[(o, a)]
        return out

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.emulated.clear()
        self.link_s.clear()
        self.blocked_s.clear()

    def hidden(self, ops: tuple[str, ...] = ("all_gather", "reduce_scatter")) -> dict[str, float]:
        """Of the flat calls of ``ops``, with a link model: the link time issued
        (``link_s``), the part of it the caller still waited for (``exposed_s``: the emulated
        waits, i.e. link time not yet over when the caller needed the result), the fraction
        hidden behind compute (1 - exposed / link, at least 0; None without a link model),
        and ``blocked_s``, every second the caller spent in those calls or their waits (also
        the real transfer and waiting for a slower peer)."""
        link = sum(v for (o, _), v in self.link_s.items() if o in ops)
        exposed = sum(v for (o, _), v in self.emulated.items() if o in ops)
        blocked = sum(v for (o, _), v in self.blocked_s.items() if o in ops)
        hidden = max(0.0, 1.0 - exposed / link) if link > 0 else None
        return {"link_s": link, "exposed_s": exposed, "blocked_s": blocked, "hidden_fraction": hidden}


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class LinkClock:
    """When this rank's emulated transfers end: one link, transfers in the order they start."""

    def __init__(self, link: Link):
        self.link, self.free_at = link, 0.0

    def end(self, start: float, op: str, num_bytes: int, ranks: int) -> float:
        begin = max(start, self.free_at)
        self.free_at = begin + self.link.seconds(op, num_bytes, ranks)
        return self.free_at


class EmulatedWork:
    """A torch ``Work`` whose ``wait`` also runs ``finish`` (the emulated wait), once."""

    def __init__(self, work, finish: Callable[[], None], keep: torch.Tensor | None = None):
        self.work, self.finish, self.keep, self.done = work, finish, keep, False

    def wait(self) -> bool:
        if not self.done:
            self.work.wait()
            self.finish()
            self.done, self.keep = True, None
        return True


class _Blocking:
    """An asynchronous flat call's work whose wait counts the seconds it blocked the caller."""

    def __init__(self, work, ledger: Ledger, key: tuple[str, str]):
        self.work, self.ledger, self.key = work, ledger, key

    def wait(self) -> bool:
        began = now()
        self.work.wait()
        self.ledger.blocked_s[self.key] += now() - began
        return True


class _Done:
    """The work of a call that moved nothing (an axis of one rank)."""

    def wait(self) -> bool:
        return True
