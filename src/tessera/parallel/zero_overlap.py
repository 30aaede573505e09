"""A ZeroEngine's collectives overlapped with compute, as FSDP2 and DeepSpeed overlap theirs:
stage 3's gather and release hooks, and the all-gathers and reduce-scatters left in flight
while modules compute.

``prefetch`` (``Plan.prefetch``) bounds how many chunks' collectives are in flight beyond
the one in use, in each direction:

- ZeRO-3 all-gathers ahead: once a module's chunks are whole, the next ``prefetch`` chunks
  in the use order (learned on the first forward, as the release points are) are
  all-gathered asynchronously while the module computes; in backward, the chunks of the
  modules before it in that order (backward's order). A chunk whose gradients are already
  reduced is never fetched again. At most ``prefetch`` whole chunks more than the
  synchronous path holds are resident at once (each freed again after its last use).
- ZeRO-2/3 reduce-scatters behind: a chunk's gradient reduce-scatter is issued when its
  gradients are complete and waited for when more than ``prefetch`` are in flight, or at
  ``finish_backward`` (each holds its flat fp32 gradient buffer until then).

``prefetch=0`` is the synchronous path: every collective waits where it is issued. Both
paths move the same bytes in the same calls and order, so training is bit-exact between them.

Where it falls back to the synchronous path: offloaded gradient reduce-scatters (the store
writes or accumulates each gradient shard into its chunk at once; the all-gathers of
offloaded chunks, from their master shards or bf16 copies, do overlap: the shard stays in
use until the wait), stage 0-1 all-reduces (they fill ``p.grad``, which a user may read right
after backward) and gathers issued before the use order is known (the first forward).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch import nn

from tessera.memory.chunk import ChunkState
from tessera.memory.chunk_manager import ParamChunk


def check_prefetch(prefetch) -> None:
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch must be a whole number of chunks >= 0 (0: no overlap), got {prefetch!r}")


class InFlight:
    """The collectives issued and not yet waited for: all-gathers by chunk, reduce-scatters
    in issue order (at most ``prefetch`` of them)."""

    def __init__(self, prefetch: int):
        check_prefetch(prefetch)
        self.prefetch = prefetch
        self.gathers: dict[ParamChunk, Callable[[], None]] = {}
        self.reduces: deque[tuple[object, Callable[[], None]]] = deque()
        self.issued = {"all_gather": 0, "reduce_scatter": 0}  # left in flight, since the start
        self.peak = {"all_gather": 0, "reduce_scatter": 0}  # the most left in flight during compute

    def add_gather(self, cg: ParamChunk, finish: Callable[[], None]) -> None:
        self.gathers[cg] = finish
        self._count("all_gather", len(self.gathers))

    def _count(self, op: str, now: int) -> None:
        self.issued[op] += 1
        self.peak[op] = max(self.peak[op], now)

    def finish_gather(self, cg: ParamChunk) -> None:
        finish = self.gathers.pop(cg, None)
        if finish is not None:
            finish()

    def add_reduce(self, work, done: Callable[[], None]) -> None:
        """``done`` runs after ``work``'s wait; the oldest are waited for beyond the bound."""
        self.reduces.append((work, done))
        while len(self.reduces) > self.prefetch:
            self._wait_oldest()
        self._count("reduce_scatter", len(self.reduces))

    def finish_reduces(self) -> None:
        while self.reduces:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        work, done = self.reduces.popleft()
        work.wait()
        done()


def upcoming(order: list[nn.Module], by_module: dict, k: int, step: int, n: int, skip) -> list[ParamChunk]:
    """The first ``n`` distinct chunks used by the modules after position ``k`` of ``order``
    (``step`` 1: forward's direction, -1: backward's), leaving out those ``skip`` says."""
    found: list[ParamChunk] = []
    i = k + step
    while 0 <= i < len(order) and len(found) < n:
        for cg in by_module[order[i]]:
            if len(found) < n and cg not in found and not skip(cg):
                found.append(cg)
        i += step
    return found


def install_stage3_hooks(engine) -> None:
    """Gather a chunk before the first module that uses it runs forward, free it after
    the last one (in the order recorded on the first forward; until then after each
    module), gather it again when backward reaches a module using it, and free it once
    its gradients are reduced; with ``engine.inflight.prefetch`` > 0, gather the next
    chunks meanwhile (the module doc)."""
    by_module: dict[nn.Module, list[ParamChunk]] = {}
    for module in engine.model.modules():
        mine = {engine.owner[p] for p in module.parameters(recurse=False) if p in engine.owner}
        if mine:
            by_module[module] = sorted(mine, key=engine.groups.index)
    shard_of = dict(zip(engine.groups, engine.shards, strict=True))
    order: list[nn.Module] = []
    last_user: dict[ParamChunk, nn.Module] = {}
    position = [0]  # the next module's place in ``order`` this forward (-1: off the learned order)
    n = engine.inflight.prefetch

    def gather(groups, after=ChunkState.HOLD_AFTER_FWD):
        for cg in groups:
            engine.gather(cg, shard_of[cg].detach(), after)

    def prefetch(k: int, step: int, after: ChunkState) -> None:
        here = by_module[order[k]]
        if step < 0:  # backward: a chunk reduced already is done for this step

            def skip(cg):
                return cg in here or engine.reduced[cg]
        else:

            def skip(cg):
                return cg in here

        for cg in upcoming(order, by_module, k, step, n, skip):
            engine.gather(cg, shard_of[cg].detach(), after, wait=False)

    at: dict[nn.Module, int] = {}  # each module's place in ``order`` this forward (-1: unknown)

    def pre_forward(module, args):
        if not last_user:
            order.append(module)
            at[module] = len(order) - 1
        elif not engine.recomputing:
            k = position[0]
            if k < 0 or k >= len(order) or order[k] is not module:
                k = -1  # a forward off the learned order (another path): no guesses from here on
            position[0], at[module] = (-1 if k < 0 else k + 1), k
        gather(by_module[module])
        if n and last_user and not engine.recomputing and at[module] >= 0:
            prefetch(at[module], 1, ChunkState.HOLD_AFTER_FWD)

    def post_forward(module, args, output):
        if engine.recomputing:
            # activation checkpointing recomputes a block inside backward: its chunks
            # stay until their gradients are reduced (the recomputed graph uses them)
            return
        groups = by_module[module]
        k = at.get(module, -1)
        if torch.is_grad_enabled():
            tensors = [
                t
                for t in torch.utils._pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:

                def backward_hook(grads, groups=groups, k=k):
                    gather(groups, ChunkState.HOLD_AFTER_BWD)
                    if n and k >= 0:
                        prefetch(k, -1, ChunkState.HOLD_AFTER_BWD)

                torch.autograd.graph.register_multi_grad_hook(tensors, backward_hook, mode="any")
        for cg in groups:
            if last_user.get(cg, module) is module:
                engine._release(cg)

    def end_of_forward(module, args, output):
        if not last_user and order:
            for m in order:
                for cg in by_module[m]:
                    last_user[cg] = m
            # parameters of modules that never ran get no gradient: a chunk waits only
            # for the others (else an unused module would keep every chunk whole
            # through backward, as reduction goes in chunk order)
            ran = {p for m in order for p in m.parameters(recurse=False)}
            for cg in engine.groups:
                engine.expected[cg] = engine.pending[cg] = sum(p in ran for p in cg.params)

    def start_of_forward(module, args):
        position[0] = 0
        if engine.offload is not None:  # chunks left whole (gather_all) go back within budget
            for cg in engine.groups:
                engine._release(cg)

    engine.model.register_forward_pre_hook(start_of_forward)
    for module in by_module:
        module.register_forward_pre_hook(pre_forward)
        module.register_forward_hook(post_forward)
    engine.model.register_forward_hook(end_of_forward)
