"""Two counts the cost model takes from the real models rather than from formulas: how many
aten ops an eager forward dispatches per block (each costs host time, whatever its size), and
how many FLOPs a VAE decoder takes (run on the meta device: no memory, no compute).

The op count of a block is the difference between two whole-model forwards that differ by
one block, so the embedding, the head and anything else outside the blocks cancel out. The
presets in tessera.plan.model_spec carry the counts measured on diffusers' Flux, SANA and
HunyuanVideo transformers (tests/plan recounts them on tiny configs: the count does not
depend on the width).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_aten_ops(fn: Callable[[], object]) -> int:
    """Aten ops ``fn()`` dispatches (views and in-place ops included: each one passes the
    dispatcher), under no_grad as inference runs; one warm-up call first."""
    with torch.no_grad():
        fn()
        counter = _OpCounter()
        with counter:
            fn()
    return counter.count


def count_block_ops(build: Callable[[int], Callable[[], object]], base: int = 1) -> int:
    """Ops of one block: ``build(n)`` returns a forward of a model with ``n`` such blocks."""
    return count_aten_ops(build(base + 1)) - count_aten_ops(build(base))


def decode_flops(decoder: torch.nn.Module, latent_shape: tuple[int, ...]) -> float:
    """FLOPs of ``decoder.decode`` on one latent of ``latent_shape``, on the meta device."""
    decoder = decoder.to("meta")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        decoder.decode(torch.empty(latent_shape, device="meta"))
    return float(counter.get_total_flops())
