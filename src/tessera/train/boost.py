"""``tessera.boost``: a user's model and optimizer, ready to train under a ``Plan``.

    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = tessera.boost(model, optimizer, tessera.Plan(dp=2, tp=2, zero=2))
    for batch in batches:                       # the same global batch on every rank
        stats = optimizer.train_step(batch, loss_fn)

``boost`` applies the tensor parallel plan (over the ``tp`` axis), makes every data-parallel
replica start from the same weights, and puts the parameters into the chunked ZeRO core
(``tessera.parallel.zero``) over the ``dp`` axis. The returned optimizer steps the sharded
states; ``train_step`` runs one optimizer step of ``grad_accum`` micro-batches on this
rank's share of the batch, under bf16 autocast if the plan says so.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn

from tessera.parallel.tp_plans import TPPlan, apply_tp, plan_for
from tessera.parallel.zero import ZeroEngine, chunk_elems_for
from tessera.runtime import Mesh
from tessera.runtime.comm import FunctionalCollectives
from tessera.runtime.mesh import world_size
from tessera.train.plan import Plan


class BoostedOptimizer:
    """The optimizer ``boost`` returns: ``step``/``zero_grad`` over the sharded core, and
    ``train_step`` for one whole step."""

    def __init__(self, model: nn.Module, engine: ZeroEngine, plan: Plan, mesh: Mesh, tp_plan: TPPlan | None):
        self.model, self.engine, self.plan, self.mesh, self.tp_plan = model, engine, plan, mesh, tp_plan
        self.last_grad_norm: float | None = None
        self._tp_calls: list[tuple[str, int]] | None = None  # DTensor's collectives in one step

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps (over ZeRO shards at stages 1-3): give it to an LR
        scheduler, e.g. ``torch.optim.lr_scheduler.LambdaLR(optimizer.inner, ...)``."""
        return self.engine.optimizer

    def step(self) -> None:
        self.last_grad_norm = self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def local_batch(self, batch):
        """This data-parallel rank's contiguous share of a global batch (dim 0 of every tensor)."""
        dp, rank = self.mesh.size("dp"), self.mesh.rank("dp")

        def take(t):
            if not isinstance(t, torch.Tensor):
                return t
            if t.shape[0] % (dp * self.plan.grad_accum):
                raise ValueError(
                    f"global batch of {t.shape[0]} does not split into dp={dp} x grad_accum={self.plan.grad_accum} "
                    "equal micro-batches"
                )
            n = t.shape[0] // dp
            return t[rank * n : (rank + 1) * n]

        return torch.utils._pytree.tree_map(take, batch)

    def loss_context(self):
        if self.tp_plan is not None and self.tp_plan.vocab_parallel_loss and self.mesh.size("tp") > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def train_step(self, batch, loss_fn: Callable[[nn.Module, object], torch.Tensor]) -> dict:
        """``loss_fn(model, micro_batch)`` returns the mean loss of that micro-batch."""
        began = time.perf_counter()
        local = self.local_batch(batch)
        k = self.plan.grad_accum
        micro = [
            torch.utils._pytree.tree_map(
                lambda t, i=i: t.chunk(k)[i] if isinstance(t, torch.Tensor) else t, local
            )
            for i in range(k)
        ]
        self.zero_grad()
        counting = self.plan.tp > 1 and self._tp_calls is None
        counter = FunctionalCollectives() if counting else contextlib.nullcontext()
        total = 0.0
        autocast = (
            torch.autocast(device_type=self.mesh.device.type, dtype=torch.bfloat16)
            if self.plan.precision == "bf16"
            else contextlib.nullcontext()
        )
        with counter:
            for i, mb in enumerate(micro):
                sync = contextlib.nullcontext() if i == k - 1 else self.engine.no_sync()
                with sync, self.loss_context():
                    with autocast:
                        loss = loss_fn(self.model, mb)
                    (loss / k).backward()
                total += float(_full(loss).detach()) / k
        if counting:
            # Tensor parallel collectives are DTensor's own: seen on the first step (their
            # pattern is the same every step) and recorded under "tp" on every step.
            self._tp_calls = counter.calls
        for op, num_bytes in self._tp_calls or ():
            self.mesh.comm.ledger.record(op, "tp", num_bytes)
        self.step()
        loss_avg = torch.tensor([total], dtype=torch.float64)
        self.mesh.comm.all_reduce(loss_avg, "dp", op="avg")
        return {
            "loss": float(loss_avg),
            "grad_norm": self.last_grad_norm,
            "seconds": time.perf_counter() - began,
        }


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def boost(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    mesh: Mesh | None = None,
    *,
    tp_plan: TPPlan | None = None,
) -> tuple[nn.Module, BoostedOptimizer]:
    """Spread ``model`` and ``optimizer`` over the processes by ``plan`` (see the module doc)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"boost needs a tessera.Plan, got {type(plan).__name__}")
    plan.check_world(world_size())
    mesh = mesh or Mesh(dp=plan.dp, tp=plan.tp)
    if mesh.size("dp") != plan.dp or mesh.size("tp") != plan.tp:
        raise ValueError(f"mesh {mesh} does not match the plan's dp={plan.dp}, tp={plan.tp}")
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                f"the optimizer holds {len(missing)} tensor(s) that are not parameters of the model"
            )
        groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "names": [names[id(p)] for p in group["params"]],
            }
        )
    if plan.tp > 1:
        tp_plan = tp_plan or plan_for(model)
        apply_tp(model, tp_plan, mesh.device_mesh["tp"], plan.tp)
    else:
        tp_plan = None
    _same_start(model, mesh)
    params = dict(model.named_parameters())
    # Same class, same per-group settings, around the (possibly re-created) parameters.
    rebuilt = type(optimizer)(
        [
            {**{k: v for k, v in g.items() if k != "names"}, "params": [params[n] for n in g["names"]]}
            for g in groups
        ]
    )
    engine = ZeroEngine(
        model,
        rebuilt,
        zero=plan.zero,
        mesh=mesh,
        axis="dp",
        chunk_elems=chunk_elems_for(plan.chunk_mib),
        max_grad_norm=plan.max_grad_norm,
        tp_axis="tp",
    )
    return model, BoostedOptimizer(model, engine, plan, mesh, tp_plan)


def _same_start(model: nn.Module, mesh: Mesh) -> None:
    """Every data-parallel replica starts from dp-rank 0's weights."""
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            mesh.comm.broadcast(local.data, "dp", src=0)
