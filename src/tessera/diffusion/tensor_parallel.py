"""Megatron-style tensor parallel for DiT inference (the baseline PipeFusion is compared
against), by the same DTensor plan training uses (``tessera.parallel.tp_plans.DIT``):
attention heads and the MLP's hidden units split over the ``tp`` axis, one all-reduce after
the attention output projection and one after the MLP, per layer.

Each rank holds only its shard of the split weights while sampling. DTensor's collectives
bypass ``Comm``; they are seen by ``FunctionalCollectives`` and recorded under ``tp`` in the
mesh's ledger, in ``Comm``'s convention (an all-reduce counts the bytes of its tensor).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tessera.diffusion.adapters import TesseraDiTAdapter
from tessera.parallel.tp_plans import apply_tp, gather_tp, plan_for
from tessera.runtime.comm import FunctionalCollectives
from tessera.runtime.mesh import Mesh

AXIS = "tp"


def is_tp_sharded(model) -> bool:
    return any(hasattr(p, "placements") for p in model.parameters())


@contextmanager
def tensor_parallel(adapter: TesseraDiTAdapter, mesh: Mesh) -> Iterator[None]:
    """The model sharded over ``mesh``'s tp axis for the duration, then gathered whole again
    (an all-gather of every split weight, not counted: it is not part of sampling). A model
    already sharded (``apply_tp(model, plan_for(model), mesh.device_mesh["tp"], n)``, once
    before many runs) is used as it is and stays sharded."""
    model, degree = adapter.model, mesh.size(AXIS)
    plan = plan_for(model)
    shard_here = not is_tp_sharded(model)
    if shard_here:  # every rank holds the same model: each takes its slice, nothing moves
        apply_tp(model, plan, mesh.device_mesh[AXIS], degree, src_data_rank=None)
    counter = FunctionalCollectives(mesh.comm, AXIS)  # counted, and timed by a link model if any
    with counter:
        yield
    for op, num_bytes in counter.calls:
        mesh.comm.ledger.record(op, AXIS, num_bytes)
    if shard_here:  # not after an error: a collective now could wait for ranks that are gone
        gather_tp(model, plan, degree)
