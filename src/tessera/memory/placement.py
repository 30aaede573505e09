"""Which chunk leaves the fast tier, and which comes in early (PatrickStar section 5).

A step of ZeRO-3 training uses its chunks in the same order every time (every rank runs
the same modules in the same order), so the order one step recorded (``trace.UseTrace``)
tells when each chunk will next be needed. ``TracePolicy`` evicts the chunk whose next
use is furthest away (Belady's MIN: the fewest fetches any policy can make for that
order) and names the next chunks to prefetch, never evicting a chunk needed before the
one it makes room for. Until a trace exists (the warm-up step) it evicts the least
recently used. ``StaticPolicy`` is ZeRO-Offload/Infinity's: every chunk goes back to the
slow tier as soon as its use ends, and nothing is fetched before it is asked for.

``simulate`` runs a policy over a use sequence without data: the dry run's prediction of
bytes moved and of the fast tier's peak.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from tessera.memory.trace import UseTrace

INF = float("inf")


class StaticPolicy:
    eager = True  # evict when a use ends
    lookahead = 0

    def __init__(self):
        self.clock = 0
        self.last: dict[str, int] = {}

    def on_use(self, key: str, nonmodel: int = 0) -> None:
        self.clock += 1
        self.last[key] = self.clock

    def next_use(self, key: str) -> float:
        return INF

    def victim(self, keys: Iterable[str]) -> str:
        return min(keys, key=lambda k: self.last.get(k, 0))  # least recently used

    def prefetch(self) -> list[str]:
        return []

    def end_step(self) -> None:
        pass


class TracePolicy(StaticPolicy):
    """Belady eviction and prefetch over the previous step's trace (LRU before one exists)."""

    eager = False

    def __init__(self, lookahead: int = 2):
        super().__init__()
        self.lookahead = lookahead
        self.trace: UseTrace | None = None  # the previous step's
        self.recording = UseTrace()
        self.position = 0  # uses so far in this step

    def on_use(self, key: str, nonmodel: int = 0) -> None:
        super().on_use(key)
        self.recording.record(key, nonmodel)
        self.position += 1

    def next_use(self, key: str) -> float:
        """Uses from now until ``key`` is next used, by the trace (wrapping into the next
        step); infinite for a chunk the trace never saw."""
        if self.trace is None:
            return INF
        positions = self.trace.positions.get(key)
        if not positions:
            return INF
        i = bisect.bisect_left(positions, self.position)
        return positions[i] if i < len(positions) else positions[0] + len(self.trace)

    def victim(self, keys: Iterable[str]) -> str:
        keys = list(keys)
        if self.trace is None:
            return super().victim(keys)
        return max(keys, key=lambda k: (self.next_use(k), -self.last.get(k, 0)))

    def prefetch(self) -> list[str]:
        if self.trace is None:
            return []
        ahead = self.trace.keys[self.position : self.position + self.lookahead]
        return list(dict.fromkeys(ahead))

    def end_step(self) -> None:
        if len(self.recording):
            self.trace = self.recording
        self.recording = UseTrace()
        self.position = 0


@dataclass
class Simulation:
    fetched: int  # bytes read into the fast tier per step (steady state)
    written: int  # bytes written back per step
    peak: int  # the fast tier's peak bytes
    fetches: int


def simulate(uses: list[tuple[str, bool]], sizes: dict[str, int], budget: float, policy) -> Simulation:
    """Two steps of ``uses`` ((key, writes) in order) under ``policy`` with a fast tier of
    ``budget`` bytes; the second step's moves are the steady state. Chunks start on the
    slow tier. Raises ValueError if one use alone does not fit."""
    resident: set[str] = set()
    dirty: set[str] = set()
    used = peak = 0
    counts = []
    for _ in range(2):
        fetched = written = fetches = 0
        for key, writes in uses:
            policy.on_use(key)
            if key not in resident:
                while used + sizes[key] > budget:
                    others = resident - {key}
                    if not others:
                        raise ValueError(f"chunk {key} needs {sizes[key]} bytes, the fast tier has {budget}")
                    out = policy.victim(others)
                    resident.discard(out)
                    used -= sizes[out]
                    if out in dirty:
                        written += sizes[out]
                        dirty.discard(out)
                resident.add(key)
                used += sizes[key]
                fetched += sizes[key]
                fetches += 1
            if writes:
                dirty.add(key)
            peak = max(peak, used)
            if policy.eager:
                resident.discard(key)
                used -= sizes[key]
                if key in dirty:
                    written += sizes[key]
                    dirty.discard(key)
        policy.end_step()
        counts.append((fetched, written, fetches))
    fetched, written, fetches = counts[-1]
    return Simulation(fetched, written, peak, fetches)
