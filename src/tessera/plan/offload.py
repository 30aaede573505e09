"""Offload as a plan dimension (Plan(zero=3, offload="static" | "auto"), tessera.memory):
what stays on the device, what moves per step, and what that costs.

Per rank, S = the ZeRO-3 model state (fp32 master shard, gradient shard, two Adam moments:
16 bytes a parameter / dp) lives in chunks. Every step each chunk is used in this order
(docs/offload.md): its master shard read for the forward's and the backward's all-gather
(2 reads), its gradient shard written and read back for the step (2), both moments read
and written (4), the master written (1) and read once more for the next forward's gather
(1): 10 transfers of a shard's 4 bytes per parameter when nothing stays on the device
(static: everything but the working set is evicted after each use; the count matches
`tessera bench offload`'s measured moved bytes). Planned placement ("auto") keeps what fits
the device budget and moves only the rest, so it moves ``10 x 4P/d x overflow`` where
overflow is the share of S beyond the budget (Belady keeps the rest resident).
Transfers overlap compute (a prefetch thread / stream), so a step takes the longer of the
two; the optimizer runs where each state chunk lives, at the host's memory bandwidth.
"""

from __future__ import annotations

import dataclasses

from tessera.plan.hardware import Hardware
from tessera.plan.model_spec import TransformerSpec
from tessera.plan.training import MASTER_BYTES, TrainPrediction, predict_train, sharded_params
from tessera.plan.training_plan import Plan

TRANSFERS_PER_STEP = 10  # shard-sized moves of each offloaded chunk per step (module doc)
OFFLOADS = (None, "static", "auto")


def offload_prediction(
    spec: TransformerSpec,
    c: Plan,
    hw: Hardware,
    *,
    global_batch: int,
    seq: int,
    host_link_bandwidth: float,
    host_memory_bandwidth: float,
    offload: str,
) -> tuple[TrainPrediction, float]:
    """(prediction, bytes moved per step and rank) for ZeRO-3 ``c`` under ``offload``."""
    if offload not in OFFLOADS[1:]:
        raise ValueError(f"offload must be one of {OFFLOADS[1:]}, got {offload!r}")
    if c.zero != 3:
        raise ValueError(f"offload needs ZeRO stage 3 (each rank offloads its own shards), got zero={c.zero}")
    base = predict_train(spec, c, hw, global_batch=global_batch, seq=seq)
    shard = sharded_params(spec, c.tp) * MASTER_BYTES / c.dp
    state = sum(base.state.values())
    layer_chunk = spec.layer_params / c.tp * MASTER_BYTES  # one block gathered whole for compute
    working = 2 * layer_chunk  # the block in use and the one prefetched
    room = max(0.0, hw.device.memory_bytes - base.activation_bytes - working)
    if offload == "static":
        resident, overflow = 0.0, 1.0
    else:
        resident = min(state, room)
        overflow = (state - resident) / state if state else 0.0
    moved = TRANSFERS_PER_STEP * shard * overflow
    compute = base.seconds
    transfer = moved / host_link_bandwidth
    host_step = 28 * sharded_params(spec, c.tp) / c.dp * overflow / host_memory_bandwidth
    seconds = max(compute, transfer) + host_step
    on_device = {k: v * (1 - overflow) for k, v in base.state.items()}
    on_device["working"] = working
    # "auto" keeps what fits on the device: that is the plan's device budget for model data
    budget = int(resident) if offload == "auto" and resident >= 1 else None
    prediction = dataclasses.replace(
        base,
        plan=dataclasses.replace(c, offload=offload, device_memory=budget),
        seconds=seconds,
        tokens_per_s=global_batch * seq / seconds,
        state=on_device,
    )
    return prediction, moved
