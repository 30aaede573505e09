"""Enumerate the valid plans for a world size, drop those that do not fit the device's
memory, rank the rest by predicted time."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tessera.diffusion.layout import ParallelConfig
from tessera.plan.hardware import Hardware
from tessera.plan.inference import GeneratePrediction, predict_generate
from tessera.plan.model_spec import TransformerSpec
from tessera.plan.offload import offload_prediction
from tessera.plan.pipeline import predict_pipeline
from tessera.plan.training import TrainPrediction, predict_train
from tessera.plan.training_plan import Plan


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def generate_configs(spec: TransformerSpec, world: int, guidance: bool) -> list[ParallelConfig]:
    """Every PipeFusion x Ulysses x Ring x CFG product equal to ``world`` (patches: the
    degree and twice it), and the TP and DistriFusion baselines over all ranks."""
    out: list[ParallelConfig] = []
    for cfg in (1, 2) if guidance else (1,):
        if world % cfg:
            continue
        rest = world // cfg
        for p, u in itertools.product(divisors(rest), repeat=2):
            if rest % (p * u) or spec.heads % u or spec.layers < p:
                continue
            r = rest // (p * u)
            for patches in sorted({p, 2 * p}) if p > 1 else (None,):
                kwargs = dict(ulysses=u, ring=r, pipefusion=p, cfg_parallel=cfg == 2)
                out.append(ParallelConfig(**kwargs, patches=patches))
    if world > 1:
        if spec.heads % world == 0:
            out.append(ParallelConfig(tp=world))
        out.append(ParallelConfig(distrifusion=world))
    return out


def expert_degrees(spec: TransformerSpec, dp: int, tp: int) -> list[int]:
    """The ep degrees a plan of ``dp`` x ``tp`` can take: 1 for a dense model; for a mixture of
    experts every divisor of dp that divides the experts (tp only with ep > 1: Tessera's tensor
    parallel plans leave the experts to ep)."""
    if not spec.experts:
        return [1]
    return [ep for ep in divisors(dp) if spec.experts % ep == 0 and (ep > 1 or tp == 1)]


def train_plans(spec: TransformerSpec, world: int, global_batch: int) -> list[Plan]:
    """dp x tp with ZeRO 0-3, block chunks (the per-block gradient reduce the model times) and
    checkpointing on or off, and for a mixture of experts every ep degree (``expert_degrees``);
    dp x pp (ZeRO 0) with as many micro-batches as the batch allows, up to 4 per stage: 1F1B,
    or GPipe where there are fewer micro-batches than stages (pipelines are simulated without
    ep)."""
    flat = [
        Plan(dp=world // tp, tp=tp, ep=ep, zero=zero, block_chunks=True, activation_checkpointing=ckpt)
        for tp in divisors(world)
        if spec.heads % tp == 0
        for ep in expert_degrees(spec, world // tp, tp)
        for zero in (0, 1, 2, 3)
        if world // tp > 1 or zero == 0
        for ckpt in (False, True)
    ]
    piped = []
    for pp in divisors(world)[1:]:
        dp = world // pp
        if spec.layers < pp or global_batch % dp:
            continue
        micro = max(m for m in divisors(global_batch // dp) if m <= 4 * pp)
        schedule = "1f1b" if micro >= pp else "gpipe"
        piped += [
            Plan(dp=dp, pp=pp, microbatches=micro, schedule=schedule, activation_checkpointing=ck)
            for ck in (False, True)
        ]
    return flat + piped


@dataclass(frozen=True)
class Ranked:
    fits: list  # predictions that fit, fastest first
    dropped: list  # predictions over the memory budget


def _rank(predictions, budget: float) -> Ranked:
    fits = sorted((p for p in predictions if p.memory_bytes_per_rank <= budget), key=lambda p: p.seconds)
    return Ranked(fits, [p for p in predictions if p.memory_bytes_per_rank > budget])


def search_generate(
    spec: TransformerSpec,
    world: int,
    hw: Hardware,
    *,
    steps: int,
    guidance: bool = True,
    batch: int = 1,
    runnable: Callable[[ParallelConfig], bool] | None = None,
) -> Ranked:
    """The layouts of ``world`` ranks ranked; ``runnable``: only those it accepts (the
    layouts the model's run would not refuse)."""
    preds: list[GeneratePrediction] = [
        predict_generate(spec, c, hw, steps=steps, guidance=guidance, batch=batch)
        for c in generate_configs(spec, world, guidance)
        if runnable is None or runnable(c)
    ]
    return _rank(preds, hw.device.memory_bytes)


def search_train(
    spec: TransformerSpec,
    world: int,
    hw: Hardware,
    *,
    global_batch: int,
    seq: int,
    offload: Sequence[str] = (),
    host_link_bandwidth: float = 25e9,
    host_memory_bandwidth: float = 50e9,
) -> Ranked:
    """The plans ranked; with ``offload`` ("static", "auto" or both) also ZeRO-3 under those
    policies (tessera.plan.offload)."""
    plans = [c for c in train_plans(spec, world, global_batch) if global_batch % c.dp == 0]
    preds: list[TrainPrediction] = [
        predict_pipeline(spec, c, hw, global_batch=global_batch, seq=seq)
        if c.pp > 1
        else predict_train(spec, c, hw, global_batch=global_batch, seq=seq)
        for c in plans
    ]
    for c in plans:
        if c.zero != 3 or c.pp > 1 or c.tp > 1 or c.ep > 1:  # offload moves ZeRO-3 chunks, without tp or ep
            continue
        for kind in offload:
            pred, _ = offload_prediction(
                spec,
                c,
                hw,
                global_batch=global_batch,
                seq=seq,
                host_link_bandwidth=host_link_bandwidth,
                host_memory_bandwidth=host_memory_bandwidth,
                offload=kind,
            )
            preds.append(pred)
    return _rank(preds, hw.device.memory_bytes)
