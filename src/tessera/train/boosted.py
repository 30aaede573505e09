"""``BoostedOptimizer``: the optimizer ``tessera.boost`` returns (see ``tessera.train.boost``):
``step`` / ``zero_grad`` over the sharded ZeRO core, ``train_step`` for one whole step under
the plan's precision and gradient accumulation, ``state_dict`` / ``load_state_dict`` in the
user's optimizer's own format."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn

from tessera.parallel.tp_plans import TPPlan
from tessera.parallel.zero import ZeroEngine
from tessera.runtime import Mesh
from tessera.runtime.functional_collectives import FunctionalCollectives
from tessera.train.full_optim_state import load_optimizer_state_dict, optimizer_state_dict
from tessera.train.loss_scale import LossScaler
from tessera.train.optimizer import PlanOptimizer
from tessera.train.plan import Plan

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class BoostedOptimizer(PlanOptimizer):
    """The optimizer ``boost`` returns: ``step``/``zero_grad`` over the sharded core,
    ``train_step`` for one whole step, and ``state_dict``/``load_state_dict`` in the
    user's optimizer's own (unsharded) format."""

    def __init__(
        self,
        model: nn.Module,
        engine: ZeroEngine,
        plan: Plan,
        mesh: Mesh,
        tp_plan: TPPlan | None,
        group_names: list[list[str]],
    ):
        self.model, self.engine, self.plan, self.mesh, self.tp_plan = model, engine, plan, mesh, tp_plan
        self.group_names = group_names  # parameter names of each of the user's groups
        self.last_grad_norm: float | None = None
        self.loss_scaler = (
            LossScaler(
                init_scale=plan.loss_scale_init,
                growth_interval=plan.loss_scale_growth_interval,
                device=mesh.device,
            )
            if plan.precision == "fp16"
            else None
        )
        self._tp_calls: list[tuple[str, int]] | None = None  # DTensor's collectives in one step

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The user's torch optimizer, which steps (over ZeRO shards at stages 1-3): an LR
        scheduler built on it before or after ``boost`` drives it."""
        return self.engine.optimizer

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer whole (a collective: ZeRO-3 chunks gathered over dp,
        tensor parallel shards over tp)."""
        if self.engine.zero == 3:
            self.engine.gather_all()
        return {name: _full(t).detach().clone() for name, t in self.model.state_dict(keep_vars=True).items()}

    def state_dict(self) -> dict:
        """The whole optimizer state as the user's torch optimizer would give it on one
        process (a collective: every rank calls it); see ``tessera.train.full_optim_state``."""
        with self.engine.resident():  # offloaded chunks come back for the gather
            return optimizer_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from ``state_dict()`` under any plan, or from a plain torch optimizer."""
        with self.engine.resident():
            load_optimizer_state_dict(self, state_dict)

    def step(self) -> bool:
        """One optimizer step over the reduced gradients; True if it was skipped (fp16 overflow)."""
        self.last_grad_norm, skipped = self.engine.step(self.loss_scaler)
        return skipped

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def loss_context(self):
        if self.tp_plan is not None and self.tp_plan.vocab_parallel_loss and self.mesh.size("tp") > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _autocast(self):
        dtype = AUTOCAST.get(self.plan.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.mesh.device.type, dtype=dtype)

    def micro_loss(self, loss_fn, micro_batch, denominator=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's loss, and what its backward runs on (the same here)."""
        if denominator is None:
            loss = loss_fn(self.model, micro_batch)
        else:
            loss = loss_fn(self.model, micro_batch, denominator=denominator)
        return loss, loss

    def data_parallel_size(self) -> int:
        """Replicas whose gradients the engine averages, each on its own share of the batch."""
        return self.mesh.size("dp")

    def denominator(self, loss_fn, batch) -> float | None:
        """A padded batch (``loss_fn.token_count``): the global count of labelled items over the
        micro-batches x replicas the plan averages, so that the average of every micro-batch's
        summed loss over it is the batch's mean (see ``tessera.train.losses``); else None."""
        count = loss_fn.token_count(batch) if hasattr(loss_fn, "token_count") else None
        if count is None:
            return None
        if count == 0:
            raise ValueError("the batch has no labelled token (every position is padding or a row's last)")
        return count / (self.plan.grad_accum * self.data_parallel_size())

    def train_step(self, batch, loss_fn: Callable[[nn.Module, object], torch.Tensor]) -> dict:
        """``loss_fn(model, micro_batch)`` returns the mean loss of that micro-batch. Returns
        {"loss", "grad_norm", "seconds"}, and at fp16 also "skipped" (this step), "skipped_steps"
        (so far) and "loss_scale" (the scale this step's loss was multiplied by)."""
        began = time.perf_counter()
        local = self.local_batch(batch)
        k = self.plan.grad_accum
        micro = [
            torch.utils._pytree.tree_map(
                lambda t, i=i: t.chunk(k)[i] if isinstance(t, torch.Tensor) else t, local
            )
            for i in range(k)
        ]
        denominator = self.denominator(loss_fn, batch)
        self.zero_grad()
        counting = self.plan.tp > 1 and self._tp_calls is None
        counter = FunctionalCollectives() if counting else contextlib.nullcontext()
        scale = float(self.loss_scaler.scale) if self.loss_scaler is not None else None
        total = 0.0
        with counter:
            for i, mb in enumerate(micro):
                sync = contextlib.nullcontext() if i == k - 1 else self.engine.no_sync()
                with sync, self.loss_context():
                    with self._autocast():
                        loss, to_backward = self.micro_loss(loss_fn, mb, denominator)
                    scaled = (
                        self.loss_scaler.scale_loss(to_backward)
                        if self.loss_scaler is not None
                        else to_backward
                    )
                    (scaled / k).backward()
                total += float(_full(loss).detach()) / k
        if counting:
            # Tensor parallel collectives are DTensor's own: seen on the first step (their
            # pattern is the same every step) and recorded under "tp" on every step.
            self._tp_calls = counter.calls
        for op, num_bytes in self._tp_calls or ():
            self.mesh.comm.ledger.record(op, "tp", num_bytes)
        skipped = self.step()
        loss_avg = torch.tensor([total], dtype=torch.float64, device=self.mesh.device)
        self.mesh.comm.all_reduce(loss_avg, "dp", op="avg")
        stats = {
            "loss": float(loss_avg),
            "grad_norm": self.last_grad_norm,
            "seconds": time.perf_counter() - began,
        }
        if self.loss_scaler is not None:
            stats.update(skipped=skipped, skipped_steps=self.skipped_steps, loss_scale=scale)
        return stats


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t
