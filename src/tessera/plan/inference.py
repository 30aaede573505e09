"""One image's sampling as the DiT methods run it, simulated op by op (tessera.diffusion's
schedules; byte volumes from tessera.diffusion.comm_bytes, so the planner and the ledger
agree by construction and by test).

Ranks are laid out as ``ParallelConfig.build_mesh`` lays them out (AXES order, Ulysses
innermost). Per layer of a group of u x r sequence-parallel ranks, on q query tokens over
k key tokens and b samples (e bytes an element, h hidden):

    compute      b (linear(q) + attention(q, k)) / (u r)
    ulysses      all-to-all of q, k, v before attention, of the output after: 4 b q h e / (u r)
    ring         r - 1 passes of the K/V block (2 b k h e / (u r)), each overlapped with the
                 attention of the block in hand
    tp           all-reduce after attention and after the MLP (2 b q h e), synchronous
    distrifusion all-gather of the band's K and V (2 b q h e / D), overlapped: only the same
                 layer of the next step reads it (synchronous in warm-up steps)
    pipefusion   stage p sends each patch's hidden states to p + 1 as soon as they are done;
                 the last stage returns the patch's new latent to stage 0, which starts that
                 patch of the next step when it arrives; warm-up steps run the whole sequence
                 through the stages one after another
    cfg          the two branches on separate rank halves, velocities exchanged every step
    host floor   eager PyTorch issues each op from the host (spec.host_ops_per_layer, counted
                 on diffusers' blocks, x hw.host_op_seconds); a layer's kernels cannot finish
                 before the host has issued them, so a layer takes at least that long
    decode       the VAE decoder (spec.decode_flops) once at the end, on one rank
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from tessera.diffusion.comm_bytes import Dims, formula_bytes
from tessera.diffusion.layout import AXES, ParallelConfig, stage_bounds
from tessera.plan.hardware import Hardware
from tessera.plan.model_spec import TransformerSpec
from tessera.plan.simulate import Schedule, simulate

# Latent elements per token: 4 channels x a 2 x 2 patch (DiT, PixArt); only the small
# latent transfers use it.
LATENT_PER_TOKEN = 16


@dataclass(frozen=True)
class GeneratePrediction:
    config: ParallelConfig
    seconds: float
    params_bytes_per_rank: float
    kv_bytes_per_rank: float
    activation_bytes_per_rank: float
    comm_bytes: int  # summed over ranks, the ledger's convention

    @property
    def memory_bytes_per_rank(self) -> float:
        return self.params_bytes_per_rank + self.kv_bytes_per_rank + self.activation_bytes_per_rank


def rank_grid(config: ParallelConfig) -> dict[tuple[int, ...], int]:
    """(cfg, pipefusion, distrifusion, tp, ring, ulysses) coordinates -> global rank."""
    degrees = [config.degree(a) for a in AXES]
    return {coords: i for i, coords in enumerate(itertools.product(*(range(d) for d in degrees)))}


class _Builder:
    def __init__(self, spec: TransformerSpec, config: ParallelConfig, hw: Hardware, steps: int, batch: int):
        self.spec, self.config, self.hw, self.steps = spec, config, hw, steps
        self.grid = rank_grid(config)
        self.sched = Schedule(ranks=config.world_size)
        self.e = hw.element_bytes
        self.batch = batch  # samples through the model on one branch's ranks

    def ranks(self, c: int, p: int, d: int = 0, t: int = 0) -> list[int]:
        """The ring x ulysses group at (cfg c, stage p, distrifusion d, tp t)."""
        cfg = self.config
        return [self.grid[(c, p, d, t, r, u)] for r in range(cfg.ring) for u in range(cfg.ulysses)]

    def layers(self, group, q: int, k: int, count: int, after: dict[int, int | None]):
        """``count`` layers on ``group``, which shares the work of ``q`` query tokens over
        ``k`` keys (a sequence-parallel group, a tp group or one rank); returns the last op
        of each rank."""
        s, hw, n = self.spec, self.hw, len(group)
        u, r, tp = self.config.ulysses, self.config.ring, self.config.tp > 1
        b, e, h = self.batch, self.e, s.hidden
        linear = hw.compute_seconds(b * s.linear_flops(q) / n)
        attention = hw.compute_seconds(b * s.attention_flops(q, k) / n)
        # the host issues every op of the layer; the GPU waits for it when its kernels are shorter
        linear = max(linear, s.host_ops_per_layer * hw.host_op_seconds - attention)
        kv_pass = hw.comm_seconds("send", 2 * b * k * h * e / n, group[:2]) if r > 1 else 0.0
        last = dict(after)

        def sync(op: str, num_bytes: float) -> None:
            nonlocal last
            done = self.sched.transfer(group, hw.comm_seconds(op, num_bytes, group), after=last.values())
            last = dict.fromkeys(group, done)

        for _ in range(count):
            if u > 1:
                sync("all_to_all", 3 * b * q * h * e / n)  # q, k, v to head-sharded layout
            # r attention blocks; block j + 1 needs the K/V block the ring delivered, and every
            # rank passes its block to the next at once (one op over the ring)
            op = {i: last[i] for i in group}
            link = None
            for block in range(r):
                for i in group:
                    op[i] = self.sched.compute(i, attention / r, after=(op[i], link))
                if block < r - 1:
                    link = self.sched.transfer(group, kv_pass, after=(link, *(last[i] for i in group)))
            last = op
            if u > 1:
                sync("all_to_all", b * q * h * e / n)  # the output back to token-sharded
            if tp:
                sync("all_reduce", b * q * h * e)  # after attention's output projection
            for i in group:
                last[i] = self.sched.compute(i, linear, after=(last[i],))
            if tp:
                sync("all_reduce", b * q * h * e)  # after the MLP
        return last


def _branch(bld: _Builder, c: int, after: dict[int, int | None]) -> dict[int, int | None]:
    """All steps of one guidance branch's ranks; returns the last op of each rank."""
    cfg, s, hw = bld.config, bld.spec, bld.hw
    n, e, h = s.tokens, bld.e, s.hidden
    last = dict(after)
    if cfg.method == "pipefusion":
        return _pipefusion(bld, c, last)
    if cfg.method == "distrifusion":
        d = cfg.distrifusion
        groups = [bld.ranks(c, 0, i) for i in range(d)]
        band = n // d
        for step in range(bld.steps):
            for g in groups:
                last.update(bld.layers(g, band, n, s.layers, {i: last.get(i) for i in g}))
            ranks = [i for g in groups for i in g]
            gather = bld.sched.transfer(
                ranks,
                hw.comm_seconds("all_gather", 2 * bld.batch * band * h * e * s.layers, ranks),
                after=last.values(),
            )
            if step < cfg.warmup_steps:  # warm-up: fresh K/V before the next step
                last = dict.fromkeys(ranks, gather)
        return last
    if cfg.tp > 1:
        group = [bld.grid[(c, 0, 0, t, 0, 0)] for t in range(cfg.tp)]
    else:
        group = bld.ranks(c, 0)
    for _ in range(bld.steps):
        last.update(bld.layers(group, n, n, s.layers, {i: last.get(i) for i in group}))
    return last


def _pipefusion(bld: _Builder, c: int, last: dict[int, int | None]) -> dict[int, int | None]:
    cfg, s, hw = bld.config, bld.spec, bld.hw
    n, e, h, b = s.tokens, bld.e, s.hidden, bld.batch
    stages = [bld.ranks(c, p) for p in range(cfg.pipefusion)]
    counts = [hi - lo for lo, hi in stage_bounds(s.layers, cfg.pipefusion, cfg.stage_layers)]
    m = cfg.patches
    sp = len(stages[0])
    returned: list[int | None] = [None] * m  # latent of patch j back at stage 0
    for step in range(bld.steps):
        pieces = [(n, 0)] if step < cfg.warmup_steps else [(math.ceil(n / m), j) for j in range(m)]
        for q, j in pieces:
            inbound = returned[j] if len(pieces) > 1 else (returned[0] if step else None)
            for p, group in enumerate(stages):
                start = {i: last.get(i) for i in group}
                if inbound is not None:
                    start = {i: inbound if p == 0 else start[i] for i in group}
                if p > 0:
                    start = {i: inbound for i in group}
                done = bld.layers(group, q, n, counts[p], start)
                last.update(done)
                if p + 1 < len(stages):
                    pair = [group[0], stages[p + 1][0]]
                    inbound = bld.sched.p2p(
                        *pair, hw.comm_seconds("send", b * q * h * e / sp, pair), after=done.values()
                    )
            tail = stages[-1]
            if len(stages) > 1:
                pair = [tail[0], stages[0][0]]
                back = bld.sched.p2p(
                    *pair,
                    hw.comm_seconds("send", b * q * LATENT_PER_TOKEN * e / sp, pair),
                    after=[last[i] for i in tail],
                )
            else:
                back = last[tail[0]]
            if len(pieces) > 1:
                returned[j] = back
            else:
                returned = [back] * m
    return last


def predict_generate(
    spec: TransformerSpec,
    config: ParallelConfig,
    hw: Hardware,
    *,
    steps: int,
    batch: int = 1,
    guidance: bool = True,
) -> GeneratePrediction:
    """Predicted seconds of one sampling run of ``steps`` steps, and memory per rank."""
    split = config.cfg_parallel
    model_batch = batch * (2 if guidance and not split else 1)
    bld = _Builder(spec, config, hw, steps, model_batch)
    ends = [_branch(bld, c, {}) for c in range(config.degree("cfg"))]
    after = [op for end in ends for op in end.values()]
    if split:  # the branches swap velocities every step: one exchange per step at the end
        ranks = list(range(config.world_size))
        latent = batch * spec.tokens * LATENT_PER_TOKEN * bld.e
        for _ in range(steps):
            after = [
                bld.sched.transfer(
                    ranks, hw.comm_seconds("all_gather", latent, [0, config.world_size // 2]), after=after
                )
            ]
    if spec.decode_flops:  # the VAE decodes the final latent once, on one rank, after every rank is done
        bld.sched.compute(0, hw.compute_seconds(batch * spec.decode_flops), after=after, name="decode")
    timeline = simulate(bld.sched)
    return GeneratePrediction(
        config=config,
        seconds=timeline.makespan,
        params_bytes_per_rank=_params_per_rank(spec, config, bld.e),
        kv_bytes_per_rank=_kv_per_rank(spec, config, model_batch, bld.e),
        activation_bytes_per_rank=model_batch
        * spec.tokens
        * (spec.ffn + 4 * spec.hidden)
        * bld.e
        / config.sp,
        comm_bytes=formula_bytes(
            config,
            Dims(
                steps=steps,
                layers=spec.layers,
                tokens=spec.tokens,
                hidden=spec.hidden,
                batch=batch,
                latent_elems=spec.tokens * LATENT_PER_TOKEN,
                guidance=guidance,
                element_bytes=bld.e,
            ),
        ),
    )


def _params_per_rank(spec: TransformerSpec, config: ParallelConfig, e: int) -> float:
    total = spec.total_params * e
    if config.method == "pipefusion":
        return (
            total
            * max(hi - lo for lo, hi in stage_bounds(spec.layers, config.pipefusion, config.stage_layers))
            / spec.layers
        )
    return total / config.tp


def _kv_per_rank(spec: TransformerSpec, config: ParallelConfig, b: int, e: int) -> float:
    kv = 2 * b * spec.tokens * spec.hidden * e  # K and V of the whole sequence, one layer
    if config.method == "pipefusion":
        counts = [hi - lo for lo, hi in stage_bounds(spec.layers, config.pipefusion, config.stage_layers)]
        return kv * max(counts) / config.sp
    if config.method == "distrifusion":
        return kv * spec.layers
    return 0.0
