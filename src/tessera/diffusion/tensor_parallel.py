"""Megatron-style tensor parallel for DiT inference (the baseline PipeFusion is compared
against), by the same DTensor plan training uses (``tessera.parallel.tp_plans.DIT``):
attention heads and the MLP's hidden units split over the ``tp`` axis, one all-reduce after
the attention output projection and one after the MLP, per layer.

diffusers' DiTs (Wan 2.1, LTX-Video, PixArt) take the plan of ``tessera.diffusion.tp_diffusers``, with
their query/key norms across heads kept exact.

Each rank holds only its shard of the split weights while sampling. DTensor's collectives
bypass ``Comm``; they are seen by ``FunctionalCollectives`` and recorded under ``tp`` in the
mesh's ledger, in ``Comm``'s convention (an all-reduce counts the bytes of its tensor).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from tessera.diffusion.adapters import Adapter
from tessera.diffusion.tp_diffusers import (
    DIFFUSERS_TP,
    check_diffusers_tp,
    diffusers_plan,
    plain_projections,
    split_norms,
    supports,
)
from tessera.models.dit import DiT
from tessera.parallel.tp_plans import TPPlan, apply_tp, check_plan, gather_tp, plan_for
from tessera.runtime.functional_collectives import FunctionalCollectives
from tessera.runtime.mesh import Mesh

AXIS = "tp"


def is_tp_sharded(model) -> bool:
    return any(hasattr(p, "placements") for p in model.parameters())


def inference_plan(model) -> TPPlan:
    """Tessera's DiT's plan or a diffusers DiT's; a ValueError naming the class otherwise."""
    if supports(model):
        return diffusers_plan(model)
    if isinstance(model, DiT):
        return plan_for(model)
    raise ValueError(
        f"tensor parallel has no plan for {type(model).__name__}; it runs Tessera's DiT and "
        f"diffusers' {', '.join(DIFFUSERS_TP)}"
    )


def check_tp(model, degree: int) -> None:
    """Every refusal of ``degree``-way tensor parallel on ``model``, before anything is split."""
    if supports(model):
        check_diffusers_tp(model, degree)
    else:
        check_plan(model, inference_plan(model), degree)


@contextmanager
def tensor_parallel(adapter: Adapter, mesh: Mesh) -> Iterator[None]:
    """The model sharded over ``mesh``'s tp axis for the duration, then gathered whole again
    (an all-gather of every split weight, not counted: it is not part of sampling). A model
    already sharded (``apply_tp(model, inference_plan(model), mesh.device_mesh["tp"], n)``, once
    before many runs) is used as it is and stays sharded."""
    model, degree = adapter.model, mesh.size(AXIS)
    plan, group = inference_plan(model), mesh.device_mesh[AXIS]
    shard_here = not is_tp_sharded(model)
    with ExitStack() as lora:
        if shard_here:  # every rank holds the same model: each takes its slice, nothing moves
            if supports(model):
                check_diffusers_tp(model, degree)
                lora.enter_context(plain_projections(model))  # a LoRA's layers: the Linears they compute
            apply_tp(model, plan, group, degree, src_data_rank=None)
        counter = FunctionalCollectives(mesh.comm, AXIS)  # counted, and timed by a link model if any
        with ExitStack() as stack:
            if supports(model):  # query/key norms across heads: exact over the split
                stack.enter_context(split_norms(model, group, group.get_local_rank(), degree))
            stack.enter_context(counter)
            yield
        for op, num_bytes in counter.calls:
            mesh.comm.ledger.record(op, AXIS, num_bytes)
        if shard_here:  # not after an error: a collective now could wait for ranks that are gone
            gather_tp(model, plan, degree)
