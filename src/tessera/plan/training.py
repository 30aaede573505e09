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

Mixture of experts (``spec.experts`` > 0) under ``Plan(ep=E)``: the experts' parameters
(``P_x``) are split over E ranks and sharded by ZeRO over the edp = d/E ranks holding the same
experts; every other parameter (``P_d``, tp-split as above) over d. Each table row applies to
each part with its own degree: e.g. stage 3 holds P_d/d + P_x/(E edp) = P_d/d + P_x/d
parameters, stage 0 P_d + P_x/E. With tp every tp rank holds its ep share of the experts whole
(P_x is not divided by t) and dispatches a 1/t slice of the tokens its tp group shares; the
slices' outputs are all-gathered over tp (and in backward the input gradients: ceil(T/t)
(2h + top_k) 4 bytes per layer and step). Each MoE layer exchanges tokens by all-to-all over
the ep group: ``tessera.parallel.expert_costs.balanced_a2a_bytes_per_rank`` of the rank's
ceil(T/t) tokens per layer and step (the formula the expert-parallel tests measure equal to
the ledger, averaged over the group: exact for the mean rank whatever the routing), the
exchanged tensors fp32 (the residual stream is fp32 under autocast). Expert gradients are
summed over tp, then reduced over edp; dense ones over d. Without ep a
MoE model is data-parallel as a dense one (every rank holds every expert; Tessera's tensor
parallel plans do not split experts, so a MoE spec gets tp only with ep).

Activations per layer and micro-batch (Korthikanti et al. 2022, "Reducing activation
recomputation", 16-bit elements; scaled by e/2): s b h (10 + 24/t + 5 a s / (h t)); with
activation checkpointing only the block input (2 s b h) is kept, plus one block's worth.
A MoE layer's MLP share (19 s b h of the dense formula, for an MLP of 4h) scales with the
experts a token takes and their width, 19 s b h x top_k f / 4h t, plus the exchanged pairs
(2 top_k s b h / t, fp32).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from tessera.parallel.expert_costs import balanced_a2a_bytes_per_rank
from tessera.plan.hardware import Hardware
from tessera.plan.model_spec import TransformerSpec
from tessera.plan.simulate import Schedule, simulate
from tessera.plan.training_plan import Plan  # the planner returns what `tessera train` runs

MASTER_BYTES = 4  # fp32 master weights, gradients and Adam moments at every precision
A2A_BYTES = 4  # tokens exchanged between experts: the fp32 residual stream (measured on CPU)


def describe(plan: Plan) -> str:
    """One line for the planner's table: the degrees, the pipeline schedule, ZeRO, checkpointing."""
    text = f"dp={plan.dp} tp={plan.tp}" + (f" ep={plan.ep}" if plan.ep > 1 else "")
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


def expert_params(spec: TransformerSpec) -> float:
    """Parameters of every layer's experts (0 for a dense model)."""
    return spec.layers * spec.expert_layer_params


def sharded_params(spec: TransformerSpec, tp: int) -> float:
    """Parameters one tp rank holds: the layers split t ways, the embedding whole."""
    layers = spec.layers * spec.layer_params
    return layers / tp + (spec.total_params - layers)


def _parts(spec: TransformerSpec, c: Plan) -> list[tuple[float, int]]:
    """(bytes a rank holds whole, the ranks ZeRO shards them over): without ep every
    parameter over dp; with ep the dense ones over dp and the experts (1/ep of them, whole on
    every tp rank) over edp = dp / ep."""
    if c.ep == 1:
        return [(sharded_params(spec, c.tp) * MASTER_BYTES, c.dp)]
    experts = expert_params(spec)
    dense = sharded_params(spec, c.tp) - experts / c.tp
    return [(dense * MASTER_BYTES, c.dp), (experts / c.ep * MASTER_BYTES, c.dp // c.ep)]


def model_state_bytes(spec: TransformerSpec, c: Plan) -> dict[str, float]:
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for p, d in _parts(spec, c):
        out["params"] += p / d if c.zero == 3 else p
        out["grads"] += {0: p, 1: p + p / d, 2: p / d, 3: p / d}[c.zero]
        out["optimizer"] += 2 * p / (d if c.zero >= 1 else 1)
    return out


def activation_bytes(spec: TransformerSpec, c: Plan, micro_batch: int, seq: int, e: int) -> float:
    s, b, h, a, t = seq, micro_batch, spec.hidden, spec.heads, c.tp
    per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * e / 2
    if spec.experts:  # the MLP share for the experts a token takes, and the exchanged pairs
        per_layer += 19 * s * b * h * (spec.top_k * spec.ffn / (4 * h * t) - 1) * e / 2
        per_layer += 2 * spec.top_k * s * b * h / t * A2A_BYTES
    if c.activation_checkpointing:
        return spec.layers * 2 * s * b * h * e / 2 + per_layer
    return spec.layers * per_layer


def comm_bytes_per_rank(spec: TransformerSpec, c: Plan, micro_batch: int, seq: int, e: int) -> dict:
    out: dict[str, float] = {}
    for (p, d), axis in zip(_parts(spec, c), ("dp", "edp"), strict=False):
        if d > 1:
            out[f"all_reduce@{axis}" if c.zero <= 1 else f"reduce_scatter@{axis}"] = p
            if c.zero in (1, 2):
                out[f"all_gather@{axis}"] = p / d
            if c.zero == 3:
                out[f"all_gather@{axis}"] = 2 * p / d
    if c.tp > 1:  # with ep the MoE blocks are not split by tp: the attention's two only
        per_layer = 2 if c.ep > 1 else 4
        out["all_reduce@tp"] = per_layer * spec.layers * micro_batch * seq * spec.hidden * e
    if c.ep > 1:
        tokens = -(-micro_batch * seq // c.tp)  # this tp rank's slice
        out["all_to_all@ep"] = spec.layers * _a2a_layer(spec, c, tokens)
        if c.tp > 1:  # the slices' outputs gathered, and in backward their input gradients
            moe = spec.layers * tokens * (2 * spec.hidden + spec.top_k) * A2A_BYTES
            out["all_gather@tp"] = out.get("all_gather@tp", 0) + moe
    return out


def _a2a_layer(spec: TransformerSpec, c: Plan, tokens: int) -> int:
    """All-to-all bytes per MoE layer and step on a rank holding ``tokens`` tokens."""
    return balanced_a2a_bytes_per_rank(
        spec.experts, tokens, spec.top_k, spec.hidden, A2A_BYTES, recomputed=c.activation_checkpointing
    )


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
    ep_group, edp_group = dp_group[: c.ep], dp_group[:: c.ep]  # consecutive dp ranks; their peers
    experts = expert_params(spec) / spec.layers if c.ep > 1 else 0.0  # apart from the dense chunks
    layer_p = (spec.layer_params - experts) / c.tp * MASTER_BYTES
    expert_p = experts / c.ep * MASTER_BYTES
    embed_p = (spec.total_params - spec.layers * spec.layer_params) * MASTER_BYTES
    fwd = hw.compute_seconds(b * spec.layer_flops(seq) / c.tp)
    act = b * seq * spec.hidden * e
    slice_tokens = -(-b * seq // c.tp)  # under tp each rank dispatches a slice of the tokens
    a2a = slice_tokens * spec.top_k * spec.hidden * A2A_BYTES  # one exchange of this rank's pairs
    last = None

    def collective(op: str, num_bytes: float, group, after) -> int:
        return sched.transfer(ranks, hw.comm_seconds(op, num_bytes, group), after=(after,))

    def gather(chunk_bytes: float, after, group=dp_group):
        return (
            collective("all_gather", chunk_bytes / len(group), group, after)
            if c.zero == 3 and len(group) > 1 and chunk_bytes
            else after
        )

    def layer(seconds: float, after, exchanges: int, gathers: int) -> int:
        op = sched.compute(0, seconds, after=(after,))
        for _ in range(1 if c.ep > 1 else 2):  # after attention and after the MLP (not a MoE block)
            if c.tp > 1:
                op = collective("all_reduce", act, tp_group, op)
        for _ in range(exchanges if c.ep > 1 else 0):  # dispatch and combine (their gradients)
            op = collective("all_to_all", a2a, ep_group, op)
        for _ in range(gathers if c.ep > 1 and c.tp > 1 else 0):  # the tp slices gathered
            op = collective("all_gather", slice_tokens * spec.hidden * A2A_BYTES, tp_group, op)
        return op

    last = gather(embed_p, last)
    last = sched.compute(0, hw.compute_seconds(b * spec.head_flops(seq)), after=(last,))
    for _ in range(spec.layers):
        last = layer(fwd, gather(expert_p, gather(layer_p, last), edp_group), 2, 1)
    backward = 2 * fwd + (fwd if c.activation_checkpointing else 0.0)
    reduce_op = "all_reduce" if c.zero <= 1 else "reduce_scatter"
    pending = []
    head_backward = 2 * hw.compute_seconds(b * spec.head_flops(seq))
    for is_layer, chunk in [(True, layer_p)] * spec.layers + [(False, embed_p)]:
        if is_layer:
            gathered = gather(expert_p, gather(chunk, last), edp_group)
            ckpt = c.activation_checkpointing
            last = layer(backward, gathered, 4 if ckpt else 2, 3 if ckpt else 2)
        else:
            last = sched.compute(0, head_backward, after=(last,))
        reductions = [(chunk, dp_group)] + ([(expert_p, edp_group)] if is_layer and expert_p else [])
        for num_bytes, group in reductions:
            if len(group) > 1:
                reduced = collective(reduce_op, num_bytes, group, last)
                pending.append(reduced)
                if not overlap:
                    last = reduced
    dense = sharded_params(spec, c.tp) - experts * spec.layers / c.tp
    owned = dense / (c.dp if c.zero >= 1 else 1)
    owned += experts * spec.layers / c.ep / (len(edp_group) if c.zero >= 1 else 1)
    # Adam reads and writes parameter, gradient and two moments (fp32): 28 bytes an element.
    step = sched.compute(0, hw.memory_seconds(28 * owned), after=[last, *pending])
    if c.zero in (1, 2) and c.dp > 1:
        collective("all_gather", dense * MASTER_BYTES / c.dp, dp_group, step)
        if experts and len(edp_group) > 1:
            collective(
                "all_gather", experts * spec.layers / c.ep * MASTER_BYTES / len(edp_group), edp_group, step
            )
    seconds = simulate(sched).makespan
    return TrainPrediction(
        plan=c,
        seconds=seconds,
        tokens_per_s=global_batch * seq / seconds,
        state=model_state_bytes(spec, c),
        activation_bytes=activation_bytes(spec, c, b, seq, e),
        comm_bytes_per_rank=comm_bytes_per_rank(spec, c, b, seq, e),
    )
