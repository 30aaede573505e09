"""A pipeline-parallel training step (pp stages x dp replicas, 1F1B or GPipe), simulated op
by op: the bubble comes out of the dependencies, it is not a formula.

Stage s holds layers [s L/pp, (s+1) L/pp) (the embedding on the first stage, the head on
the last); the global batch is cut into m micro-batches per replica. 1F1B: stage s runs
pp - s - 1 forwards, then alternates one forward and one backward, then the remaining
backwards. F(s, i) needs F(s-1, i)'s activations (a send), B(s, i) needs B(s+1, i)'s
gradient (a send) and its own F(s, i). After its last backward each stage all-reduces its
gradients over dp (ZeRO 0; its own group, overlapping nothing), then steps. GPipe (the
schedule the planner gives fewer micro-batches than stages, which 1F1B does not take) runs
every forward, then every backward.
Memory per rank: the stage's model state (ZeRO 0 formulas on 1/pp of the layers) and the
activations of the micro-batches in flight (1F1B: at most pp on stage 0; GPipe: all m).
"""

from __future__ import annotations

from tessera.plan.hardware import Hardware
from tessera.plan.model_spec import TransformerSpec
from tessera.plan.simulate import Schedule, simulate
from tessera.plan.training import MASTER_BYTES, TrainPrediction, activation_bytes
from tessera.plan.training_plan import Plan


def one_f_one_b(stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The order of ("F" | "B", micro-batch) a stage runs."""
    warm = min(stages - stage - 1, micro)
    order = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while b < micro:
        if f < micro:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def gpipe(stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """GPipe: every forward, then every backward."""
    return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]


def predict_pipeline(
    spec: TransformerSpec, c: Plan, hw: Hardware, *, global_batch: int, seq: int
) -> TrainPrediction:
    """``c.microbatches`` micro-batches per replica under ``c.schedule`` ("1f1b" or "gpipe")."""
    if c.schedule not in ("1f1b", "gpipe") or c.virtual_stages != 1:
        raise ValueError(f"the pipeline model simulates 1f1b and gpipe, got schedule={c.schedule!r}")
    pp, m = c.pp, c.microbatches
    if global_batch % (c.dp * m):
        raise ValueError(f"global batch {global_batch} does not split into dp {c.dp} x {m} micro-batches")
    if spec.layers < pp:
        raise ValueError(f"{spec.layers} layers cannot fill {pp} pipeline stages")
    mb, e = global_batch // (c.dp * m), hw.element_bytes
    layers = [spec.layers // pp + (1 if s < spec.layers % pp else 0) for s in range(pp)]
    fwd = [hw.compute_seconds(mb * n * spec.layer_flops(seq)) for n in layers]
    fwd[-1] += hw.compute_seconds(mb * spec.head_flops(seq))
    act = hw.comm_seconds("send", mb * seq * spec.hidden * e, [0, 1])
    sched = Schedule(ranks=pp)
    done: dict[tuple[str, int, int], int] = {}
    order = one_f_one_b if c.schedule == "1f1b" else gpipe
    orders = [order(s, pp, m) for s in range(pp)]
    # Issue in an order that respects the dependencies: sweep the stages until all are issued.
    cursor, sent = [0] * pp, {}
    while any(cursor[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while cursor[s] < len(orders[s]):
                kind, i = orders[s][cursor[s]]
                src = s - 1 if kind == "F" else s + 1
                needs = [] if (kind == "F" and s == 0) or (kind == "B" and s == pp - 1) else [(kind, src, i)]
                if kind == "B":
                    needs.append(("F", s, i))
                if any(n not in done for n in needs):
                    break
                after = [sent.get(n, done[n]) for n in needs]
                seconds = fwd[s] * (1 if kind == "F" else 2 + c.activation_checkpointing)
                done[(kind, s, i)] = sched.compute(s, seconds, after=after)
                nxt = s + 1 if kind == "F" else s - 1
                if 0 <= nxt < pp:
                    sent[(kind, s, i)] = sched.p2p(s, nxt, act, after=(done[(kind, s, i)],))
                cursor[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")  # a bug in one_f_one_b, never user input
    for s in range(pp):
        stage_params = (
            layers[s] * spec.layer_params + (spec.total_params - spec.layers * spec.layer_params) / 2
        ) / c.tp
        last = done[("B", s, m - 1)]
        if c.dp > 1:
            group = list(range(0, c.dp * pp, pp))[: c.dp]
            last = sched.transfer(
                [s], hw.comm_seconds("all_reduce", stage_params * MASTER_BYTES, group), after=(last,)
            )
        sched.compute(s, hw.memory_seconds(28 * stage_params), after=(last,))
    seconds = simulate(sched).makespan
    p = (
        max(layers) * spec.layer_params + (spec.total_params - spec.layers * spec.layer_params)
    ) * MASTER_BYTES
    state = {"params": p, "grads": p, "optimizer": 2 * p}
    per_layer = activation_bytes(spec, c, mb, seq, e) / spec.layers
    return TrainPrediction(
        plan=c,
        seconds=seconds,
        tokens_per_s=global_batch * seq / seconds,
        state=state,
        activation_bytes=per_layer * max(layers) * (min(pp, m) if c.schedule == "1f1b" else m),
        comm_bytes_per_rank={
            "send@pp": 2 * m * mb * seq * spec.hidden * e,
            "all_reduce@dp": p if c.dp > 1 else 0,
        },
    )
