"""``TrainOptimizer``: the one interface of what ``tessera.boost`` returns as the optimizer,
under every plan (data, tensor, pipeline, sequence, expert parallel, ZeRO 0-3, offload).

``boost`` builds one of three classes: ``BoostedOptimizer`` (the ZeRO core,
``tessera.train.boosted``), ``SequenceParallelOptimizer`` (sp > 1, ``tessera.train.sequenced``)
or ``PipelinedOptimizer`` (pp > 1, ``tessera.train.pipelined``). Each satisfies
``TrainOptimizer``, so a training script, an export, a checkpoint or a resume is written once
against it and never asks which one it holds. ``PlanOptimizer`` is their common base: the
batch split (``local_batch``), the fp16 skip count and the groups are written there once.
Gradient clipping is one rule for every path (``tessera.memory.clip``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from torch import nn

    from tessera.runtime import Mesh
    from tessera.train.plan import Plan


@runtime_checkable
class TrainOptimizer(Protocol):
    """What every plan's boosted optimizer offers.

    - ``train_step(batch, loss_fn)``: one optimizer step on this rank's share of the global
      ``batch`` (the same on every rank); returns ``{"loss", "grad_norm", "seconds"}`` (fp16
      adds ``"skipped"``, ``"skipped_steps"``, ``"loss_scale"``). ``loss_fn`` is a
      ``tessera.train.losses.TrainLoss``: a plain ``loss_fn(model, micro_batch)`` serves dp
      and tp; pp and sp need a loss that says how it splits (``causal_lm_loss`` does).
    - ``zero_grad()`` / ``step()``: the two halves of a step for a hand-written backward
      (``step`` returns True when fp16 skipped it).
    - ``state_dict()`` / ``load_state_dict(sd)``: the whole optimizer state in the user's torch
      optimizer's own (unsharded) format; collectives: every rank calls them.
    - ``full_state()``: every model parameter and buffer whole (a collective).
    - ``inner``: the user's torch optimizer (an LR scheduler is built on it);
      ``param_groups`` its groups; ``skipped_steps`` fp16 overflow skips so far (0 otherwise);
      ``last_grad_norm`` the last step's global gradient norm (None without clipping).
    - ``model``, ``plan``, ``mesh``; ``group_names`` (each group's parameter names) and
      ``param_shapes`` (shapes of parameters this rank released: other pipeline stages'),
      which checkpoints read, with ``engine``: the sharding core (``ZeroEngine``, or a
      pipelined rank's ``StageEngine`` (``tessera.train.stage_engine``)) whose ``resident()`` and ``load_local`` they call.
    """

    model: nn.Module
    plan: Plan
    mesh: Mesh
    group_names: list[list[str]]
    param_shapes: dict[str, list[int]]
    last_grad_norm: float | None
    loss_scaler: Any
    engine: Any

    @property
    def inner(self) -> torch.optim.Optimizer: ...

    @property
    def param_groups(self) -> list[dict]: ...

    @property
    def skipped_steps(self) -> int: ...

    def train_step(self, batch, loss_fn) -> dict: ...

    def step(self) -> bool: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...

    def full_state(self) -> dict[str, torch.Tensor]: ...

    def local_batch(self, batch): ...


class PlanOptimizer:
    """The parts every boosted optimizer shares. A subclass sets ``model``, ``plan``, ``mesh``,
    ``group_names``, ``loss_scaler`` and ``inner`` and says how the batch is split
    (``batch_split``)."""

    param_shapes: dict[str, list[int]] = {}  # nothing released (pipelined ranks override it)
    last_grad_norm: float | None = None

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def skipped_steps(self) -> int:
        """fp16: optimizer steps skipped because gradients overflowed (0 otherwise)."""
        return self.loss_scaler.skipped_steps if self.loss_scaler is not None else 0

    def batch_split(self) -> tuple[int, int, str, int]:
        """(replicas that take different rows, this rank's replica, name of the per-replica
        split, its count): e.g. (dp, dp rank, "grad_accum", k)."""
        return self.mesh.size("dp"), self.mesh.rank("dp"), "grad_accum", self.plan.grad_accum

    def local_batch(self, batch):
        """This replica's contiguous share of a global batch (dim 0 of every tensor), on the
        mesh's device (recipes build batches on the CPU: a no-op there)."""
        replicas, index, name, pieces = self.batch_split()

        def take(t):
            if not isinstance(t, torch.Tensor):
                return t
            if t.shape[0] % (replicas * pieces):
                raise ValueError(
                    f"global batch of {t.shape[0]} does not split into dp={replicas} x {name}={pieces} equal "
                    f"micro-batches; use a batch size that is a multiple of {replicas * pieces}"
                )
            n = t.shape[0] // replicas
            return t[index * n : (index + 1) * n].to(self.mesh.device)

        return torch.utils._pytree.tree_map(take, batch)
