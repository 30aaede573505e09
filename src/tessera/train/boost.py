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
with dynamic loss scaling, ``tessera.train.loss_scale``). Under every plan the returned
optimizer is a ``tessera.train.optimizer.TrainOptimizer`` (pipelined and sequence parallel
plans return their own classes of it).

Every check comes first (``_validate``), on sizes and metadata only: the tensor parallel
plan is applied to a meta copy of the model, the offload budgets, dry run and directory are
checked over a meta copy of the ZeRO-3 chunk layout, pipeline stages are counted. A refused
plan leaves the model, its parameters (objects, values, storage, device), its hooks and the
optimizer (groups and state) as they were, so ``boost`` can be called again on them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass

import torch
from torch import nn

from tessera.memory.chunk_manager import ChunkManager
from tessera.memory.offload import check_offload
from tessera.parallel.tp_plans import TPPlan, apply_tp, plan_for
from tessera.parallel.zero import ZeroEngine, chunk_elems_for
from tessera.runtime import Mesh
from tessera.runtime.mesh import world_size
from tessera.train.blocks import blocks_or_error, checkpoint_blocks
from tessera.train.boosted import BoostedOptimizer
from tessera.train.meta_model import check_meta, empty_parameters
from tessera.train.optimizer import TrainOptimizer
from tessera.train.plan import Plan, check_chunk_size

__all__ = ["BoostedOptimizer", "TrainOptimizer", "boost", "plan_mesh"]

log = logging.getLogger(__name__)

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
    init=None,
) -> tuple[nn.Module, TrainOptimizer]:
    """Spread ``model`` and ``optimizer`` over the processes by ``plan`` (see the module doc).
    Every refusal comes before the model or the optimizer is changed (``_validate``).
    A model whose parameters are on the meta device is made chunk by chunk, ``init(module)``
    (default: its own init) initialising each (``tessera.train.meta_model``)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"boost needs a tessera.Plan, got {type(plan).__name__}")
    if _is_transformers_model(model) and (plan.tp > 1 or plan.pp > 1 or plan.sp > 1 or plan.ep > 1):
        # these plans read transformers' tp/ep plans, mask functions and attention interface
        from tessera.compat import check_versions

        check_versions("transformers")
    plan.check_world(world_size())
    mesh = mesh or plan_mesh(plan)
    _check_mesh(mesh, plan)
    setup = _validate(model, optimizer, plan, mesh, tp_plan)
    setup.init = check_meta(model, plan, init)
    # Nothing below refuses a plan: from here on the model and the optimizer change.
    if plan.pp > 1:
        return _boost_pipelined(model, optimizer, plan, mesh, setup)
    return _boost(model, optimizer, plan, mesh, setup)


@dataclass
class _Setup:
    """What the validation found, for the changes that follow it."""

    group_names: list[list[str]]  # parameter names of each of the optimizer's groups
    tp_plan: TPPlan | None
    blocks: list[nn.Module]  # transformer blocks (checkpointed or chunked by block), else []
    loaded: dict | None  # the state the optimizer held, loaded again after boost
    ep_plan: dict[str, str] | None = None  # expert parallel plan, one entry per name (ep > 1)
    init: object = None  # a model on the meta device: what initialises its modules (meta_model)


def _is_transformers_model(model) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def _validate(model, optimizer, plan: Plan, mesh: Mesh, tp_plan: TPPlan | None) -> _Setup:
    """Every check boost makes, on the model's sizes and metadata (tensor parallel on a
    meta copy, offload on a meta chunk layout): nothing here changes the model, its
    parameters or the optimizer."""
    _check_storage(model)
    group_names = _check_optimizer(model, optimizer, plan)
    loaded = optimizer.state_dict() if optimizer.state else None
    if loaded is not None and plan.pp > 1:
        raise ValueError(f"Plan(pp={plan.pp}) starts from a fresh optimizer; load its state after boost")
    if plan.pp > 1:
        wanted = ["activation_checkpointing"] if plan.activation_checkpointing else []
    else:
        wanted = [n for n in ("block_chunks", "activation_checkpointing") if getattr(plan, n)]
    blocks = blocks_or_error(model, wanted[0]) if wanted else []
    ep_plan = None
    if plan.ep > 1:
        from tessera.parallel.experts import ep_plan_of

        ep_plan = ep_plan_of(model, plan.ep)
    tp_names: set[str] = set()
    if plan.tp > 1:
        if tp_plan is None and ep_plan is not None:  # the MoE blocks belong to ep
            from tessera.parallel.experts import attention_plan

            tp_plan = attention_plan(plan_for(model), model, ep_plan)
        tp_plan = tp_plan or plan_for(model)
        tp_names = _check_tp(model, tp_plan, mesh, plan)
    else:
        tp_plan = None
    if loaded is not None:
        _check_loaded_state(model, optimizer, loaded, plan, tp_names)
    if plan.pp > 1:
        _check_stages(model, plan)
    if plan.sp > 1:
        if getattr(model, "config", None) is None:
            raise ValueError(
                f"Plan(sp={plan.sp}) runs a transformers model's attention sequence-parallel; "
                f"{type(model).__name__} has no config: use sp=1"
            )
        from tessera.parallel.sequence import check_sequence_parallel

        check_sequence_parallel(model)
    if plan.offload is not None:
        _check_offload(model, optimizer, plan, mesh, blocks)
    return _Setup(group_names, tp_plan, blocks, loaded, ep_plan)


def _check_storage(model: nn.Module) -> None:
    """A parameter without storage (a model boosted at ZeRO-3 already: its chunks are
    emptied between uses) would be read out of bounds."""
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel() and local.device.type != "meta" and local.untyped_storage().nbytes() == 0:
            raise ValueError(
                f"parameter {name} has no storage (boost at zero=3 empties it; was this model boosted "
                "already?): boost a freshly built or loaded model"
            )


def _meta_copy(model: nn.Module) -> nn.Module:
    """``model`` with every parameter and buffer on the meta device (no data copied)."""
    memo: dict[int, torch.Tensor] = {}
    for t in (*model.parameters(), *model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _check_tp(model: nn.Module, tp_plan: TPPlan, mesh: Mesh, plan: Plan) -> set[str]:
    """The tensor parallel plan applied to a meta copy of the model (every check
    ``apply_tp`` makes, GPT-2's layout change included, with no data and no communication);
    the names of the parameters it shards."""
    try:
        shadow = _meta_copy(model)
    except TypeError as e:  # an attribute deepcopy cannot copy (a lock, a handle)
        log.warning(
            "cannot copy %s to check its tensor parallel plan before changing it (%s): a refused plan "
            "will be refused after the model was sharded",
            type(model).__name__,
            e,
        )
        return {n for n, _ in model.named_parameters()}  # as if all were sharded: the stricter state check
    apply_tp(
        shadow,
        tp_plan,
        mesh.device_mesh["tp"],
        plan.tp,
        src_data_rank=None,
        sequence_parallel=plan.sequence_parallel_norms,
    )
    return {n for n, p in shadow.named_parameters() if hasattr(p, "placements")}


def _check_loaded_state(model, optimizer, loaded: dict, plan: Plan, tp_names: set[str]) -> None:
    """A state the plan shards (ZeRO >= 1, or a tensor parallel parameter) must be
    per-element or scalar (``tessera.train.full_optim_state`` loads it after boost)."""
    names = {id(p): n for n, p in model.named_parameters()}
    for group, saved in zip(optimizer.param_groups, loaded["param_groups"], strict=True):
        for p, index in zip(group["params"], saved["params"], strict=True):
            name = names[id(p)]
            if plan.zero == 0 and name not in tp_names:
                continue
            for key, value in loaded["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() != p.numel():
                    raise ValueError(
                        f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, neither the "
                        f"parameter's {tuple(p.shape)} nor a scalar: it cannot be sharded"
                    )


def _check_stages(model: nn.Module, plan: Plan) -> None:
    """The model cuts into the plan's pipeline stages (``tessera.parallel.pipeline``)."""
    from tessera.parallel.pipeline import balanced_counts, check_stages, layer_costs, num_layers, stage_bounds

    total = plan.pp * plan.virtual_stages
    counts = plan.stage_layers
    if counts == "balanced":
        costs, first, last = layer_costs(model)
        counts = balanced_counts(costs, total, first=first, last=last)
    stage_bounds(num_layers(model), total, counts)
    check_stages(model)  # the stages together are the model's own forward (a probe batch)
    is_dit = all(hasattr(model, n) for n in ("blocks", "condition", "embed", "head"))
    if plan.sp > 1 and is_dit:
        raise ValueError(
            f"Plan(pp={plan.pp}, sp={plan.sp}): sequence parallel pipeline stages are built for transformers "
            "causal LMs, not the DiT; use sp=1"
        )


def _check_offload(model: nn.Module, optimizer, plan: Plan, mesh: Mesh, blocks: list[nn.Module]) -> None:
    """The offload plan over the chunk layout ZeRO-3 will make, built from meta copies of
    the parameters (``tessera.memory.offload.check_offload``); a parameter larger than the
    chunk size is refused (its chunk would be larger than the budgets assume)."""
    check_chunk_size(model, plan)
    meta = {p: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad) for p in model.parameters()}
    groups = [{"params": [meta[p] for p in g["params"]]} for g in optimizer.param_groups]
    segment_of = (
        {meta[p]: i for i, block in enumerate(blocks) for p in block.parameters()}
        if plan.block_chunks
        else None
    )
    dp = mesh.size("dp")
    manager = ChunkManager(
        groups, chunk_elems=chunk_elems_for(plan.chunk_mib), align=dp, segment_of=segment_of
    )
    check_offload(
        manager, optimizer, dp=dp, device=mesh.device, rank=mesh.rank("dp"), prefetch=plan.prefetch,
        **_offload_settings(plan),
    )  # fmt: skip


def _boost(model, optimizer, plan: Plan, mesh: Mesh, setup: _Setup):
    sp_mesh = None
    has_tp = "tp" in mesh.axes  # a data-parallel-only mesh may have no tp axis
    if plan.sp > 1:  # ZeRO and the gradient average span dp x sp; attention talks over sp
        # (dp x sp, tp) lays the ranks out as (dp, sp, tp) does: the same tp groups
        sp_mesh, mesh = mesh, Mesh(dp=plan.dp * plan.sp, **({"tp": plan.tp} if has_tp else {}))
    expert_mesh, expert_params = _spread(model, optimizer, plan, mesh, setup)
    # Any state the optimizer held (loaded by the user) was taken whole by _validate and is
    # loaded again below into whatever shards and pieces the plan makes.
    optimizer.state.clear()
    segment_of = (
        {p: i for i, block in enumerate(setup.blocks) for p in block.parameters()}
        if plan.block_chunks
        else None
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
        offload=_offload_settings(plan),
        expert_mesh=expert_mesh,
        expert_params=expert_params,
        prefetch=plan.prefetch,
        init=setup.init,
    )
    if plan.activation_checkpointing:
        checkpoint_blocks(
            model, setup.blocks, context_fn=lambda: (contextlib.nullcontext(), _recomputation(model, engine))
        )
    args = (model, engine, plan, mesh, setup.tp_plan, setup.group_names)
    if sp_mesh is None:
        boosted = BoostedOptimizer(*args)
    else:
        from tessera.train.sequenced import SequenceParallelOptimizer

        boosted = SequenceParallelOptimizer(*args, sp_mesh=sp_mesh)
    if setup.loaded is not None:
        boosted.load_state_dict(setup.loaded)
    return model, boosted


@contextlib.contextmanager
def _recomputation(model: nn.Module, engine: ZeroEngine | None):
    """Activation checkpointing recomputes a block: ZeRO-3 keeps its chunks, and expert
    dispatches count their tokens once (``tessera.parallel.experts.recomputation``)."""
    from tessera.parallel.experts import recomputation

    with engine.recomputation() if engine is not None else contextlib.nullcontext(), recomputation(model):
        yield


def _apply_experts(model, plan: Plan, mesh: Mesh, setup: _Setup):
    """ep > 1: the experts split over ep ranks (after every replica has the same weights);
    the expert mesh and the expert parameters for ZeRO. (None, None) otherwise."""
    if setup.ep_plan is None:
        return None, None
    from tessera.parallel.experts import apply_experts, expert_mesh_for

    expert_mesh = expert_mesh_for(mesh, plan.ep)
    params = apply_experts(model, setup.ep_plan, expert_mesh, capacity_factor=plan.capacity_factor)
    return expert_mesh, params


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


def _boost_pipelined(model, optimizer, plan: Plan, mesh: Mesh, setup: _Setup):
    """Plan(pp > 1): stages of the model on each rank (``tessera.train.pipelined``)."""
    from tessera.train.pipelined import PipelinedOptimizer

    expert_mesh, expert_params = _spread(model, optimizer, plan, mesh, setup)
    if plan.activation_checkpointing:
        checkpoint_blocks(
            model, setup.blocks, context_fn=lambda: (contextlib.nullcontext(), _recomputation(model, None))
        )
    experts = None if expert_mesh is None else (expert_mesh, expert_params)
    return model, PipelinedOptimizer(
        model, optimizer, plan, mesh, experts=experts, group_names=setup.group_names
    )


def _spread(model, optimizer, plan: Plan, mesh: Mesh, setup: _Setup):
    """What every plan does to the model first, in one place: onto the mesh's device (in
    place: the optimizer's parameters stay the model's), the tensor parallel plan over ``tp``,
    every replica from dp-rank 0's weights, the experts over ``ep``, and the optimizer's groups
    holding the re-created (DTensor) parameters. The expert mesh and parameters, or (None, None)."""
    if setup.init is not None:  # parameters with empty storage on the device, for the chunks to fill
        empty_parameters(model, mesh.device)
    model.to(mesh.device)
    if setup.tp_plan is not None:
        # sequence_parallel_norms is refused under pp (Plan._check_sequence): False there
        apply_tp(
            model,
            setup.tp_plan,
            mesh.device_mesh["tp"],
            plan.tp,
            sequence_parallel=plan.sequence_parallel_norms,
        )
    if setup.init is None:  # else each chunk is broadcast once initialised (ZeroEngine)
        _same_start(model, mesh)
    expert_mesh, expert_params = _apply_experts(model, plan, mesh, setup)
    _regroup(model, optimizer, setup.group_names)
    return expert_mesh, expert_params


def _regroup(model: nn.Module, optimizer: torch.optim.Optimizer, group_names: list[list[str]]) -> None:
    """The optimizer's groups hold the model's parameters again (tensor parallel re-created some)."""
    params = dict(model.named_parameters())
    for group, names in zip(optimizer.param_groups, group_names, strict=True):
        group["params"] = [params[n] for n in names]


def _offload_settings(plan: Plan) -> dict | None:
    if plan.offload is None:
        return None
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
