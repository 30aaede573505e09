"""The warm-up trace: the order in which one training step used its chunks, and the
non-model memory (activations, temporaries, the runtime) on the compute tier at each use.
PatrickStar (section 5) records the same in a warm-up iteration and places chunks by it."""

from __future__ import annotations


class UseTrace:
    def __init__(self):
        self.keys: list[str] = []
        self.nonmodel: list[int] = []
        self.positions: dict[str, list[int]] = {}

    def record(self, key: str, nonmodel: int = 0) -> None:
        self.positions.setdefault(key, []).append(len(self.keys))
        self.keys.append(key)
        self.nonmodel.append(nonmodel)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nonmodel_peak(self) -> int:
        return max(self.nonmodel, default=0)
