"""One training step of ``tessera.boost`` (dp x tp, ZeRO 0-3), simulated op by op, and the
memory it holds per rank.

Model state per rank, P the parameters in fp32 (4 bytes each; bf16/fp16 keep fp32 master
weights), d the dp degree, t the tp degree (tp shards the layers, not the embedding), Adam's
two moments (parallel/zero.py's table):

    stage   parameters   gradients            optimizer
    0       P            P                    2P
    1       P            P + P/d (the shard)  2P/d
    2       P            P/d                  2P/d
    3       P/d          P/d                  2P/d

Communication per rank per step (the ledger's convention, tessera.runtime.comm): stage 0 and
1 all-reduce the gradients (P), stages 2 and 3 reduce-scatter them (P); stages 1 and 2
all-gather the updated shards (P/d), stage 3 gathers every chunk before its forward and
again before its backward (2P/d). tp all-reduces the activations twice per layer in the
forward and twice in the backward. Gradients are reduced chunk by chunk as backward
finishes each block (``block_chunks``); boost's collectives are synchronous, so the next
block's backward waits for them (``overlap=True`` models an asynchronous implementation).

Activations per layer and micro-batch (Korthikanti et al. 2022, "Reducing activation
recomputation", 16-bit elements; scaled by e/2): s b h (10 + 24/t + 5 a s / (h t)); with
activation checkpointing only the block input (2 s b h) is kept, plus one block's worth.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from tessera.plan.hardware import Hardware
from tessera.plan.model_spec import TransformerSpec
from tessera.plan.simulate import Schedule, simulate
from tessera.plan.training_plan import Plan  # the planner returns what `tessera train` runs

MASTER_BYTES = 4  # fp32 master weights, gradients and Adam moments at every precision


def describe(plan: Plan) -> str:
    """One line for the planner's table: the degrees, the pipeline schedule, ZeRO, checkpointing."""
    text = f"dp={plan.dp} tp={plan.tp}"
    if plan.pp > 1:
        text += f" pp={plan.pp} ({plan.schedule}, {plan.microbatches} micro)"
    text += f" zero={plan.zero}" + (" ckpt" if plan.activation_checkpointing else "")
    return text + (f" offload={plan.offload}" if plan.offload else "")


@dataclass(frozen=True)
class TrainPrediction:
    plan: Plan
    seconds: float
    tokens_per_s: float
    state: dict[str, float]  # params, grads, optimizer: bytes per rank
    activation_bytes: float
    comm_bytes_per_rank: dict[str, float]

    @property
    def memory_bytes_per_rank(self) -> float:
        return sum(self.state.values()) + self.activation_bytes

    @property
    def candidate(self) -> Plan:
        """The old name of ``plan``: kept for one release, then removed."""
        warnings.warn(
            "TrainPrediction.candidate is renamed plan; the old name goes in the next release",
            FutureWarning,
            stacklevel=2,
        )
        return self.plan


def sharded_params(spec: TransformerSpec, tp: int) -> float:
    """Parameters one tp rank holds: the layers split t ways, the embedding whole."""
    layers = spec.layers * spec.layer_params
    return layers / tp + (spec.total_params - layers)


def model_state_bytes(spec: TransformerSpec, c: Plan) -> dict[str, float]:
    p = sharded_params(spec, c.tp) * MASTER_BYTES
    d = c.dp
    params = p / d if c.zero == 3 else p
    grads = {0: p, 1: p + p / d, 2: p / d, 3: p / d}[c.zero]
    optimizer = 2 * p / (d if c.zero >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer}


def activation_bytes(spec: TransformerSpec, c: Plan, micro_batch: int, seq: int, e: int) -> float:
    s, b, h, a, t = seq, micro_batch, spec.hidden, spec.heads, c.tp
    per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * e / 2
    if c.activation_checkpointing:
        return spec.layers * 2 * s * b * h * e / 2 + per_layer
    return spec.layers * per_layer


def comm_bytes_per_rank(spec: TransformerSpec, c: Plan, micro_batch: int, seq: int, e: int) -> dict:
    p = sharded_params(spec, c.tp) * MASTER_BYTES
    d = c.dp
    out: dict[str, float] = {}
    if d > 1:
        out["all_reduce@dp" if c.zero <= 1 else "reduce_scatter@dp"] = p
        if c.zero in (1, 2):
            out["all_gather@dp"] = p / d
        if c.zero == 3:
            out["all_gather@dp"] = 2 * p / d
    if c.tp > 1:
        out["all_reduce@tp"] = 4 * spec.layers * micro_batch * seq * spec.hidden * e
    return out


def predict_train(
    spec: TransformerSpec,
    c: Plan,
    hw: Hardware,
    *,
    global_batch: int,
    seq: int,
    overlap: bool = False,
) -> TrainPrediction:
    if c.pp > 1:
        raise ValueError(
            f"{describe(c)}: pipeline plans are predicted by tessera.plan.pipeline.predict_pipeline"
        )
    if global_batch % c.dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp {c.dp}")
    b, e = global_batch // c.dp, hw.element_bytes
    sched = Schedule(ranks=c.world_size)
    ranks = list(range(c.world_size))
    dp_group, tp_group = ranks[: c.dp * c.tp : c.tp], ranks[: c.tp]  # the groups of rank 0
    layer_p = spec.layer_params / c.tp * MASTER_BYTES
    embed_p = (spec.total_params - spec.layers * spec.layer_params) * MASTER_BYTES
    fwd = hw.compute_seconds(b * spec.layer_flops(seq) / c.tp)
    act = b * seq * spec.hidden * e
    last = None

    def collective(op: str, num_bytes: float, group, after) -> int:
        return sched.transfer(ranks, hw.comm_seconds(op, num_bytes, group), after=(after,))

    def gather(chunk_bytes: float, after):
        return (
            collective("all_gather", chunk_bytes / c.dp, dp_group, after)
            if c.zero == 3 and c.dp > 1
            else after
        )

    def layer(seconds: float, after) -> int:
        op = sched.compute(0, seconds, after=(after,))
        for _ in range(2):  # after attention and after the MLP
            if c.tp > 1:
                op = collective("all_reduce", act, tp_group, op)
        return op

    last = gather(embed_p, last)
    last = sched.compute(0, hw.compute_seconds(b * spec.head_flops(seq)), after=(last,))
    for _ in range(spec.layers):
        last = layer(fwd, gather(layer_p, last))
    backward = 2 * fwd + (fwd if c.activation_checkpointing else 0.0)
    reduce_op = "all_reduce" if c.zero <= 1 else "reduce_scatter"
    pending = []
    head_backward = 2 * hw.compute_seconds(b * spec.head_flops(seq))
    for is_layer, chunk in [(True, layer_p)] * spec.layers + [(False, embed_p)]:
        if is_layer:
            last = layer(backward, gather(chunk, last))
        else:
            last = sched.compute(0, head_backward, after=(last,))
        if c.dp > 1:
            reduced = collective(reduce_op, chunk, dp_group, last)
            pending.append(reduced)
            if not overlap:
                last = reduced
    owned = sharded_params(spec, c.tp) / (c.dp if c.zero >= 1 else 1)
    # Adam reads and writes parameter, gradient and two moments (fp32): 28 bytes an element.
    step = sched.compute(0, hw.memory_seconds(28 * owned), after=[last, *pending])
    if c.zero in (1, 2) and c.dp > 1:
        collective("all_gather", sharded_params(spec, c.tp) * MASTER_BYTES / c.dp, dp_group, step)
    seconds = simulate(sched).makespan
    return TrainPrediction(
        plan=c,
        seconds=seconds,
        tokens_per_s=global_batch * seq / seconds,
        state=model_state_bytes(spec, c),
        activation_bytes=activation_bytes(spec, c, b, seq, e),
        comm_bytes_per_rank=comm_bytes_per_rank(spec, c, b, seq, e),
    )
