"""``tessera.boost``: a user's model and optimizer, ready to train under a ``Plan``.

    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = tessera.boost(model, optimizer, tessera.Plan(dp=2, tp=2, zero=2))
    for batch in batches:                       # the same global batch on every rank
        stats = optimizer.train_step(batch, loss_fn)

``boost`` moves the model to the mesh's device, applies the tensor parallel plan (over the
``tp`` axis), makes every data-parallel replica start from the same weights, wraps each
transformer block in activation checkpointing if the plan says so, and puts the parameters
into the chunked ZeRO core (``tessera.parallel.zero``) over the ``dp`` axis. The user's
optimizer object is kept (its class, settings, hooks and any state it had loaded); at ZeRO
1-3 it steps flat shards, so its update must be elementwise. The returned optimizer steps
the sharded states; ``train_step`` runs one optimizer step of ``grad_accum`` micro-batches
on this rank's share of the batch, under bf16 or fp16 autocast if the plan says so (fp16
with dynamic loss scaling, ``tessera.train.loss_scale``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tessera.parallel.tp_plans import TPPlan, apply_tp, plan_for
from tessera.parallel.zero import ZeroEngine, chunk_elems_for
from tessera.runtime import Mesh
from tessera.runtime.mesh import world_size
from tessera.train.blocks import blocks_or_error, checkpoint_blocks
from tessera.train.boosted import BoostedOptimizer
from tessera.train.plan import Plan, check_chunk_size

__all__ = ["BoostedOptimizer", "boost", "plan_mesh"]

# ZeRO 1-3 step each chunk's flat shard as one tensor: right for updates that treat every
# element on its own (with per-group scalars such as Adam's step), wrong for ones that look
# at a parameter's shape or norm (Adafactor's factored moments, Muon, LBFGS, LAMB/LARS).
ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "Adagrad",
        "RMSprop",
        "Rprop",
        "Adadelta",
        "ASGD",
    )
)


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan) -> list[list[str]]:
    """The parameter names of each of the optimizer's groups (it must hold model parameters,
    and be elementwise at ZeRO >= 1)."""
    if plan.zero >= 1 and type(optimizer) not in ELEMENTWISE:
        known = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(
            f"Plan(zero={plan.zero}) steps flat shards of parameters, which needs an elementwise optimizer "
            f"({known}); {type(optimizer).__name__} is not one: use Plan(zero=0)"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    group_names = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                f"the optimizer holds {len(missing)} tensor(s) that are not parameters of the model"
            )
        group_names.append([names[id(p)] for p in group["params"]])
    return group_names


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
    mesh = mesh or plan_mesh(plan)
    _check_mesh(mesh, plan)
    has_tp = "tp" in mesh.axes  # a data-parallel-only mesh may have no tp axis
    group_names = _check_optimizer(model, optimizer, plan)
    if plan.pp > 1:
        return _boost_pipelined(model, optimizer, plan, mesh, tp_plan, group_names)
    sp_mesh = None
    if plan.sp > 1:  # ZeRO and the gradient average span dp x sp; attention talks over sp
        # (dp x sp, tp) lays the ranks out as (dp, sp, tp) does: the same tp groups
        sp_mesh, mesh = mesh, Mesh(dp=plan.dp * plan.sp, **({"tp": plan.tp} if has_tp else {}))
    blocks = (
        blocks_or_error(model, "block_chunks" if plan.block_chunks else "activation_checkpointing")
        if plan.block_chunks or plan.activation_checkpointing
        else []
    )
    # Any state the optimizer holds (loaded by the user) is taken whole now and loaded
    # again below into whatever shards and pieces the plan makes.
    loaded = optimizer.state_dict() if optimizer.state else None
    model.to(mesh.device)  # in place: the optimizer's parameters stay the model's
    if plan.tp > 1:
        tp_plan = tp_plan or plan_for(model)
        apply_tp(
            model, tp_plan, mesh.device_mesh["tp"], plan.tp, sequence_parallel=plan.sequence_parallel_norms
        )
    else:
        tp_plan = None
    _same_start(model, mesh)
    params = dict(model.named_parameters())
    for group, names in zip(optimizer.param_groups, group_names, strict=True):
        group["params"] = [params[n] for n in names]  # tensor parallel re-created some
    optimizer.state.clear()
    segment_of = (
        {p: i for i, block in enumerate(blocks) for p in block.parameters()} if plan.block_chunks else None
    )
    engine = ZeroEngine(
        model,
        optimizer,
        zero=plan.zero,
        mesh=mesh,
        axis="dp",
        chunk_elems=chunk_elems_for(plan.chunk_mib),
        max_grad_norm=plan.max_grad_norm,
        tp_axis="tp" if has_tp else None,
        segment_of=segment_of,
        offload=_offload_settings(model, plan),
    )
    if plan.activation_checkpointing:
        checkpoint_blocks(
            model, blocks, context_fn=lambda: (contextlib.nullcontext(), engine.recomputation())
        )
    if sp_mesh is None:
        boosted = BoostedOptimizer(model, engine, plan, mesh, tp_plan, group_names)
    else:
        from tessera.train.sequenced import SequenceParallelOptimizer

        boosted = SequenceParallelOptimizer(model, engine, plan, mesh, tp_plan, group_names, sp_mesh=sp_mesh)
    if loaded is not None:
        boosted.load_state_dict(loaded)
    return model, boosted


def plan_mesh(plan: Plan) -> Mesh:
    """The plan's mesh: pipeline outermost, tensor parallel innermost (the fastest links),
    data and sequence parallel between; a size-1 pp or sp axis is left out."""
    axes = {"pp": plan.pp, "dp": plan.dp, "sp": plan.sp, "tp": plan.tp}
    return Mesh(**{n: s for n, s in axes.items() if n in ("dp", "tp") or s > 1})


def _check_mesh(mesh: Mesh, plan: Plan) -> None:
    for name in ("dp", "tp", "pp", "sp"):
        size = mesh.size(name) if name in mesh.axes else 1
        if size != getattr(plan, name):
            raise ValueError(f"mesh {mesh} has {name}={size} but the plan asks {name}={getattr(plan, name)}")


def _boost_pipelined(model, optimizer, plan: Plan, mesh: Mesh, tp_plan, group_names):
    """Plan(pp > 1): stages of the model on each rank (``tessera.train.pipelined``)."""
    from tessera.train.pipelined import PipelinedOptimizer

    if optimizer.state:
        raise ValueError(f"Plan(pp={plan.pp}) starts from a fresh optimizer; load its state after boost")
    model.to(mesh.device)
    if plan.tp > 1:
        apply_tp(model, tp_plan or plan_for(model), mesh.device_mesh["tp"], plan.tp)
        params = dict(model.named_parameters())
        for group, names in zip(optimizer.param_groups, group_names, strict=True):
            group["params"] = [params[n] for n in names]
    _same_start(model, mesh)
    if plan.activation_checkpointing:
        checkpoint_blocks(model, blocks_or_error(model, "activation_checkpointing"))
    return model, PipelinedOptimizer(model, optimizer, plan, mesh)


def _offload_settings(model: nn.Module, plan: Plan) -> dict | None:
    """The store's settings from the plan; a chunk size below the largest parameter is
    refused under offload (that parameter's chunk would be larger than the budgets assume)."""
    if plan.offload is None:
        return None
    check_chunk_size(model, plan)
    return dict(
        policy=plan.offload,
        device_memory=plan.device_memory,
        host_memory=plan.host_memory,
        offload_dir=plan.offload_dir,
    )


def _same_start(model: nn.Module, mesh: Mesh) -> None:
    """Every data-parallel replica starts from dp-rank 0's weights."""
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            mesh.comm.broadcast(local.data, "dp", src=0)
