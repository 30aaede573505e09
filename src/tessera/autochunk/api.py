"""``tessera.autochunk``: trace a module with shapes, find where activation memory peaks,
and compute those regions in slices so the peak drops.

    chunked = tessera.autochunk(model, (x, mask), max_memory=512 * 2**20)
    out = chunked(x, mask)           # same result, less activation memory
    print(chunked.plan.describe())   # what was chunked, estimated peak before and after

The plan is made for the example inputs' shapes (and dtypes); calling with other shapes is
an error that names them — make a new plan for a new length. Parameters stay the module's
own (the chunked module holds it as ``.module``), so training it or loading a state dict into
it changes what the chunked module computes too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from tessera.autochunk.codegen import apply_regions
from tessera.autochunk.memory import MemoryModel
from tessera.autochunk.search import ChunkPlan, MiB, plan


def trace(module: nn.Module, example_inputs: tuple):
    """The module's forward as a pre-dispatch ATen graph over (params, *inputs), with fake
    tensor values (shapes, dtypes, storage aliasing) on every node; no real compute."""
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}

    def forward(state, *args):
        return functional_call(module, state, args)

    return make_fx(forward, tracing_mode="fake", pre_dispatch=True)(state, *example_inputs)


def _signature(inputs) -> list:
    return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in inputs]


class AutoChunked(nn.Module):
    """A module computing what ``module`` computes, with the planned regions in slices."""

    def __init__(self, module: nn.Module, graph_module: torch.fx.GraphModule, chunk_plan: ChunkPlan, signature):
        super().__init__()
        self.module = module
        self.graph_module = graph_module
        self.plan = chunk_plan
        self._signature = signature

    def forward(self, *inputs):
        if _signature(inputs) != self._signature:
            raise ValueError(
                f"this autochunk plan was made for inputs {self._signature}, got {_signature(inputs)}; "
                "call tessera.autochunk again for the new shapes"
            )
        state = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        return self.graph_module(state, *inputs)


def autochunk(
    module: nn.Module, example_inputs, max_memory: int | None = None, *, slack: float = 1.1
) -> AutoChunked:
    """Chunk ``module``'s activation-heavy regions for inputs shaped like ``example_inputs``.

    ``max_memory`` (bytes) bounds the estimated activation memory: what the forward
    allocates beyond its inputs and parameters, with autograd off (with it on, autograd's
    saved tensors come on top, and no loop writes into a dying input's storage). Each chunked
    region then runs in the largest slices that fit. Kernels' own small work buffers (flash
    attention's, about 0.5 MiB a thread on CPU) are not in the estimate: leave a few MiB. Without it, regions are sliced until the highest unchunked
    step of the graph is the peak (or a region's slices are within ``slack`` of the least
    it can reach). A budget below what any chunking reaches raises ``BudgetError`` with
    the numbers.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"autochunk needs an nn.Module, got {type(module).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    if not any(isinstance(t, torch.Tensor) for t in example_inputs):
        raise ValueError("example_inputs must hold at least one tensor (a tuple of the forward's arguments)")
    if max_memory is not None and (not isinstance(max_memory, int) or max_memory <= 0):
        raise ValueError(f"max_memory must be a positive number of bytes, got {max_memory!r}")
    if slack < 1.0:
        raise ValueError(f"slack must be >= 1.0, got {slack}")
    gm = trace(module, example_inputs)
    model = MemoryModel(gm)
    chunk_plan = plan(model, max_memory=max_memory, slack=slack)
    apply_regions(gm, chunk_plan.regions, model.order)
    return AutoChunked(module, gm, chunk_plan, _signature(example_inputs))


def estimate_peak(module: nn.Module, example_inputs) -> int:
    """Estimated activation bytes of the unchunked forward (same model as the planner's)."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    return MemoryModel(trace(module, tuple(example_inputs))).timeline([]).peak


__all__ = ["AutoChunked", "MiB", "autochunk", "estimate_peak", "trace"]
