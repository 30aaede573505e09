"""The batch-latency table cost(length, batch size) the DP scheduler plans with
(TurboTransformers, Fang et al. PPoPP 2021, section 5: "cached_cost", measured once by
running the model at a grid of shapes when the server starts).

A cell is the seconds one forward of ``batch`` inputs all of ``length`` tokens takes on
the runner that will serve. Between grid points the cost is interpolated linearly (in
length, then in batch size); the table is made non-decreasing in both, which is what
makes contiguous batches of the length-sorted queue optimal (see `dp_scheduler.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Forward = Callable[[list[list[int]]], object]


@dataclass
class CostTable:
    lengths: list[int]  # grid, increasing
    batch_sizes: list[int]  # grid, increasing, starts at 1
    seconds: list[list[float]]  # seconds[i][j]: lengths[i] x batch_sizes[j]
    measured: int = 0  # cells run on the model (the rest filled by scaling)
    measure_seconds: float = 0.0

    def __post_init__(self) -> None:
        grid = np.maximum.accumulate(np.maximum.accumulate(np.asarray(self.seconds, float), 0), 1)
        self.seconds = grid.tolist()
        self._dense: dict[tuple[int, int], list[list[float]]] = {}

    @classmethod
    def from_function(
        cls, cost: Callable[[int, int], float], lengths: Sequence[int], batch_sizes: Sequence[int]
    ) -> CostTable:
        return cls(list(lengths), list(batch_sizes), [[cost(n, b) for b in batch_sizes] for n in lengths])

    @classmethod
    def measure(
        cls,
        forward: Forward,
        *,
        max_length: int,
        max_batch_size: int,
        max_batch_tokens: int,
        token_id: int = 1,
        lengths: Sequence[int] | None = None,
        batch_sizes: Sequence[int] | None = None,
        linear_ratio: float = 0.95,
    ) -> CostTable:
        """Time ``forward`` on the grid (one warm-up, then the best of two runs per cell).

        Along each length's row, batch sizes grow until batching stops paying: once a
        doubling keeps at least ``linear_ratio`` of the per-input time, the rest of the
        row is that cell scaled linearly (measuring it would only confirm the line, and the
        big cells are most of the start-up time). Cells over the token budget are never
        run; they are infeasible to the scheduler and only shape the interpolation."""
        lengths = sorted({min(n, max_length) for n in (lengths or _length_grid(max_length))})
        batch_sizes = sorted({min(b, max_batch_size) for b in (batch_sizes or _batch_grid(max_batch_size))})
        began = time.perf_counter()
        forward([[token_id] * lengths[0]])  # first call pays one-time set-up
        table, measured = [], 0
        for n in lengths:
            row: list[float] = []
            linear = False
            for j, b in enumerate(batch_sizes):
                if row and (linear or n * b > max_batch_tokens):
                    row.append(row[-1] * b / batch_sizes[j - 1])
                    continue
                sequences = [[token_id] * n for _ in range(b)]
                row.append(min(_timed(forward, sequences) for _ in range(2)))
                measured += 1
                linear = j > 0 and row[-1] / b >= linear_ratio * row[-2] / batch_sizes[j - 1]
            table.append(row)
        return cls(lengths, batch_sizes, table, measured, time.perf_counter() - began)

    def cost(self, length: int, batch: int) -> float:
        by_batch = [np.interp(length, self.lengths, column) for column in np.asarray(self.seconds).T]
        return float(np.interp(batch, self.batch_sizes, by_batch))

    def dense(self, max_length: int, max_batch: int) -> list[list[float]]:
        """rows[length][batch] for every length 0..max_length and batch 0..max_batch (the
        DP looks costs up by index; row 0 and column 0 are unused zeros)."""
        key = (max_length, max_batch)
        if key not in self._dense:
            grid = np.asarray(self.seconds)
            by_length = np.stack([np.interp(np.arange(max_length + 1), self.lengths, c) for c in grid.T], 1)
            rows = np.stack([np.interp(np.arange(max_batch + 1), self.batch_sizes, r) for r in by_length])
            rows[:, 0] = 0.0
            self._dense[key] = rows.tolist()
        return self._dense[key]

    def to_dict(self) -> dict:
        return {
            "lengths": self.lengths,
            "batch_sizes": self.batch_sizes,
            "seconds": self.seconds,
            "measured_cells": self.measured,
            "measure_seconds": self.measure_seconds,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostTable:
        return cls(data["lengths"], data["batch_sizes"], data["seconds"])


def _timed(forward: Forward, sequences: list[list[int]]) -> float:
    began = time.perf_counter()
    forward(sequences)
    return time.perf_counter() - began


def _length_grid(max_length: int) -> list[int]:
    return [n for n in (8, 32, 64, 128, 256, 384) if n < max_length] + [max_length]


def _batch_grid(max_batch: int) -> list[int]:
    return [b for b in (1, 2, 4, 8, 16) if b < max_batch] + [max_batch]
