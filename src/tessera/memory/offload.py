"""A ZeRO-3 rank's model data in tiered chunks: what ``tessera.parallel.zero`` asks of the
store when it offloads (PatrickStar on the ZeRO chunk core).

Per chunk ``i`` of the rank's ZeRO-3 layout there are:

- ``p{i}``: the fp32 master shard (kind PARAM). Used to all-gather the whole chunk before
  a module's forward (then HOLD_AFTER_FWD) and backward (then HOLD_AFTER_BWD), and written
  by the optimizer step (then HOLD).
- ``g{i}``: the reduced gradient shard (GRAD), made by backward's reduce-scatter, read by
  clipping and the step, then RELEASED (no copy kept anywhere).
- ``s{i}.<name>``: each per-element optimizer state of that shard (OPTIM; Adam's
  ``exp_avg`` and ``exp_avg_sq`` are two chunks), adopted when the optimizer creates it.

The optimizer step runs chunk by chunk where the chunk's data is brought: the user's own
optimizer steps one shard at a time (the others have no gradient, so torch skips them).
The arithmetic is the one the whole-model step does, element by element, so training
with offload is bit-exact with training without it. On the CPU that step is torch's
AdamW as the user built it: the default single-tensor loop, or ``foreach=True``, or
``fused=True`` (torch's vectorised CPU kernel, ZeRO-Offload's "CPU Adam" in all but
name): Tessera does not substitute its own, so results stay those of the user's optimizer.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from tessera.memory.chunk import ChunkKind, ChunkState
from tessera.memory.clip import clip_coefficient
from tessera.memory.store import TieredStore, build_store, check_device_memory
from tessera.memory.tiers import check_dir


def _check_need(name: str, budget: int | None, need: int) -> None:
    if budget is not None and budget < need:
        raise ValueError(
            f"Plan.{name}={budget} bytes is below what the largest chunk needs on the compute tier "
            f"({need} bytes: its whole chunk and shard, or its shard's master, gradient and two moments); "
            "raise it or lower Plan.chunk_mib"
        )


def _state_tensors(optimizer: torch.optim.Optimizer) -> int:
    """Per-element states the optimizer will keep per parameter (for the dry run): none
    for plain SGD, one for SGD with momentum, else Adam's two (the most torch's
    elementwise optimizers keep)."""
    if isinstance(optimizer, torch.optim.SGD):
        return int(any(g.get("momentum", 0) for g in optimizer.param_groups))
    return 2


def _bf16_autocast(kind: str) -> bool:
    """Whether forward runs under bf16 autocast on this device type (never on ``meta``,
    the dry run's, which autocast does not know)."""
    if kind == "meta":
        return False
    return torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.bfloat16


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _need(whole: list[int], shard_bytes: list[int]) -> int:
    """Bytes the largest chunk's use holds on the compute tier at once: its whole chunk and
    its shard (the all-gather), or its shard's master, gradient and two moments."""
    return max(max(w + b for w, b in zip(whole, shard_bytes, strict=True)), 4 * max(shard_bytes))


def _check_in_flight(name: str, budget: int | None, whole: list[int], shard_bytes: list[int], prefetch: int):
    """ZeRO-3's prefetch (``tessera.parallel.zero_overlap``) holds the chunk in use and up to
    ``prefetch`` more whole on the compute tier at once, each of those with the shard it is
    gathered from: the largest ones must fit the budget."""
    if budget is None or prefetch == 0:
        return
    held = sum(sorted(whole, reverse=True)[: 1 + prefetch]) + sum(
        sorted(shard_bytes, reverse=True)[:prefetch]
    )
    if held > budget:
        raise ValueError(
            f"Plan.prefetch={prefetch} holds up to {min(1 + prefetch, len(whole))} whole chunks at once, "
            f"{prefetch} of them still being gathered from their shards ({held} bytes), more than "
            f"Plan.{name}={budget} bytes; lower Plan.prefetch (0: no overlap) or Plan.chunk_mib, or raise "
            f"Plan.{name} to at least {held}"
        )


def _dry_run(manager, log, numels, *, budget_name: str, **settings) -> None:
    """``replay`` (``tessera.memory.dry_run``) of the store uses ``log`` over meta tensors; a
    refusal names the compute tier's budget."""
    from tessera.memory.dry_run import replay

    try:
        replay(manager, log, numels, **settings)
    except ValueError as e:
        budget = settings[budget_name]
        raise ValueError(f"Plan.{budget_name}={budget} refused before training (dry run): {e}") from None


def check_offload(
    manager,
    optimizer,
    *,
    dp: int,
    device: torch.device,
    rank: int,
    policy: str,
    device_memory: int | None,
    host_memory: int | None,
    offload_dir,
    prefetch: int = 0,
) -> None:
    """Every refusal of offloading a rank's ZeRO-3 chunks of ``manager`` (its chunks' data
    is neither read nor changed: meta tensors will do), made before anything is bound,
    freed or built, each with the numbers: a compute-tier budget below what the largest
    chunk's use needs, or than the chunks ``prefetch`` keeps in flight need, ``device_memory`` without CUDA, the dry run of one step over this
    layout, and the offload directory (writable, with room for every shard's bytes)."""
    whole = [cg.chunk.capacity * cg.chunk.buffer.element_size() for cg in manager.chunks]
    numels = [cg.chunk.capacity // dp for cg in manager.chunks]
    shard_bytes = [4 * n for n in numels]  # fp32 master shards
    name = "device_memory" if device.type == "cuda" else "host_memory"
    budget = device_memory if name == "device_memory" else host_memory
    _check_need(name, budget, _need(whole, shard_bytes))
    _check_in_flight(name, budget, whole, shard_bytes, prefetch)
    check_device_memory(device, device_memory)
    from tessera.memory.dry_run import engine_log

    log = engine_log(whole, numels, state_tensors=_state_tensors(optimizer), clip=False, prefetch=prefetch)
    _dry_run(
        manager, log, numels, policy=policy, device=device, device_memory=device_memory,
        host_memory=host_memory, disk=offload_dir is not None, budget_name=name,
    )  # fmt: skip
    if offload_dir is not None:  # last: a refused budget leaves no directory behind
        check_dir(Path(offload_dir) / f"rank{rank}", 4 * sum(shard_bytes))


class ShardOffload:
    def __init__(self, store: TieredStore, optimizer: torch.optim.Optimizer, shards: list):
        self.store, self.optimizer, self.shards = store, optimizer, shards
        self.whole: list[int] = []  # bytes of each whole chunk (set by create())
        self.state_keys: list[dict[str, str]] = [{} for _ in shards]
        self.need, self.budget_name = 0, "host_memory"  # set by create(), with layout and policy
        self.in_flight: tuple[list[int], list[int], int] = ([], [], 0)  # whole, shard bytes, prefetch
        self.low = False  # this step's forward ran under bf16 autocast: gather the bf16 copies
        for i, shard in enumerate(shards):
            store.register(f"p{i}", ChunkKind.PARAM, shard.data)
            store.done(f"p{i}", ChunkState.HOLD)

    # ---- forward and backward ---------------------------------------------------------------
    def reserve(self, i: int) -> None:
        """Room for whole chunk ``i`` on the compute tier (before it is gathered into)."""
        self.store.reserve_compute(self.whole[i], f"whole chunk {i} for compute")

    def release(self, i: int) -> None:
        """Whole chunk ``i`` freed after its last use: its room back."""
        self.store.release_compute(self.whole[i])

    @contextlib.contextmanager
    def master(self, i: int, after: ChunkState):
        """Chunk ``i``'s master shard on the compute tier for an all-gather."""
        yield self.store.use(f"p{i}")
        self.store.done(f"p{i}", after)

    def gather_into(
        self, buffer: torch.Tensor, i: int, after: ChunkState, comm, axis: str, *, async_op=False
    ):
        """All-gather chunk ``i`` into ``buffer`` (the whole fp32 chunk) from the master
        shards; when forward runs under bf16 autocast (and in the backward after it), from
        their bf16 copies ``b{i}`` instead (PatrickStar's low-precision parameter chunks):
        half the bytes read from the slow tier and sent to the other ranks. Every op that
        autocast runs in bf16 then sees the very weights it would have (its cast of the
        master rounds to nearest even, as the copy did); ops it keeps in fp32 (embedding
        lookups, layer norms) see the rounded values instead of the master's.

        ``async_op``: the all-gather is left in flight and a function returned that waits for
        it (the shard, or its copy, stays in use on the compute tier until then, and the bf16
        staging is widened into ``buffer`` then); None otherwise."""
        if after is ChunkState.HOLD_AFTER_FWD:  # gather_all (export, saving) is never autocast
            self.low = _bf16_autocast(buffer.device.type)
        if not self.low:
            shard = self.store.use(f"p{i}")
            work = comm.all_gather_into(buffer, shard, axis, async_op=async_op)

            def finish() -> None:
                if work is not None:
                    work.wait()
                self.store.done(f"p{i}", after)

        else:
            staging = _nbytes(buffer) // 2  # the bf16 whole chunk, before it is widened into buffer
            self.store.reserve_compute(staging, f"bf16 staging of whole chunk {i}")
            try:
                whole = torch.empty(buffer.shape, dtype=torch.bfloat16, device=buffer.device)
                work = comm.all_gather_into(whole, self._low_copy(i, after), axis, async_op=async_op)
            except BaseException:
                self.store.release_compute(staging)
                raise

            def finish() -> None:
                try:
                    if work is not None:
                        work.wait()
                    self.store.done(f"b{i}", after)
                    buffer.copy_(whole)
                finally:
                    self.store.release_compute(staging)

        if async_op:
            return finish
        finish()
        return None

    def _low_copy(self, i: int, after: ChunkState) -> torch.Tensor:
        """Chunk ``i``'s bf16 copy, in use; made from the master the first time (the
        optimizer step refreshes it after that)."""
        key = f"b{i}"
        if key in self.store.chunks:
            return self.store.use(key)
        with self.master(i, after) as shard:
            copy = shard.to(torch.bfloat16)
        self.store.register(key, ChunkKind.PARAM_LOW, copy)
        return copy

    def reduced_into(self, i: int, reduce) -> None:
        """``reduce(out)`` writes the rank's gradient shard of chunk ``i`` into ``out``; a
        second micro-batch of the step adds to the first's (gradient accumulation)."""
        key = f"g{i}"
        shard = self.shards[i]
        if key in self.store.chunks:
            held = self.store.use(key, write=True)
            part = torch.empty_like(held)
            reduce(part)
            held.add_(part)
        else:
            grad = torch.empty(shard.shape, dtype=torch.float32, device=shard.device)
            self.store.register(key, ChunkKind.GRAD, grad)
            reduce(grad)
        self.store.done(key, ChunkState.HOLD_AFTER_BWD)

    # ---- the optimizer step, chunk by chunk -------------------------------------------------
    def grad_sq_sum(self, i: int) -> torch.Tensor:
        """Chunk ``i``'s squared gradient norm in float64 (as the in-memory step sums it)."""
        g = self.store.use(f"g{i}")
        part = g.double().pow(2).sum()
        self.store.done(f"g{i}", ChunkState.HOLD_AFTER_BWD)
        return part

    def scale_grad(self, i: int, scale: float) -> None:
        g = self.store.use(f"g{i}", write=True)
        g.mul_(scale)
        self.store.done(f"g{i}", ChunkState.HOLD_AFTER_BWD)

    def step_chunk(self, i: int) -> None:
        shard = self.shards[i]
        self.store.use(f"p{i}", write=True)
        grad = self.store.use(f"g{i}")
        for key in self.state_keys[i].values():
            self.store.use(key, write=True)
        shard.grad = grad
        self.optimizer.step()  # only this shard has a gradient: torch skips the others
        shard.grad = None
        self.adopt_states(i)
        self.store.done(f"g{i}", ChunkState.RELEASED)
        for key in self.state_keys[i].values():
            self.store.done(key, ChunkState.HOLD)
        self._refresh_low(i)
        self.store.done(f"p{i}", ChunkState.HOLD)

    def _refresh_low(self, i: int) -> None:
        """The bf16 copy made again from the stepped master (in use): written whole, so an
        evicted copy is given room without being read."""
        key = f"b{i}"
        if key in self.store.chunks:
            self.store.use(key, fresh=True).copy_(self.shards[i].detach())
            self.store.done(key, ChunkState.HOLD)

    def adopt_states(self, i: int) -> None:
        """Each per-element state tensor of shard ``i`` becomes (or stays) a chunk of its
        own; one the optimizer replaced (a loaded state) takes its chunk's place. Chunks
        are left in use (COMPUTE)."""
        shard = self.shards[i]
        keys = self.state_keys[i]
        for name, value in self.optimizer.state.get(shard, {}).items():
            if not isinstance(value, torch.Tensor) or value.shape != shard.shape:
                continue  # a scalar (Adam's step) stays where it is
            key = keys.get(name)
            if key is not None and self.store.chunks[key].tensor is value:
                continue
            if key is not None:
                self.store.done(key, ChunkState.RELEASED)
            keys[name] = f"s{i}.{name}"
            self.store.register(keys[name], ChunkKind.OPTIM, value)

    @contextlib.contextmanager
    def resident(self):
        """Every chunk on the compute tier, budget suspended (checkpoint save and load)."""
        with self.store.all_resident():
            yield
            for i in range(len(self.shards)):
                self.adopt_states(i)  # left in use: all_resident puts them back
                if f"b{i}" in self.store.chunks:  # a loaded master: its bf16 copy follows
                    self.store.chunks[f"b{i}"].tensor.copy_(self.shards[i].detach())

    @classmethod
    def create(
        cls, manager, optimizer, shards, whole: list[torch.Tensor], *, device, rank, prefetch=0, **settings
    ):
        """Tier a rank's ``shards`` (``whole``: each chunk's full buffer). The layout was
        checked first (``check_offload``, before any chunk was bound or freed)."""
        name = "device_memory" if device.type == "cuda" else "host_memory"
        shard_bytes = [_nbytes(s) for s in shards]
        store = build_store(manager, device=device, rank=rank, disk_need=4 * sum(shard_bytes), **settings)
        offload = cls(store, optimizer, shards)
        offload.whole = [_nbytes(w) for w in whole]
        offload.need = _need(offload.whole, shard_bytes)
        offload.in_flight = [_nbytes(w) for w in whole], shard_bytes, prefetch
        offload.budget_name = name
        offload.layout = [_nbytes(w) for w in whole], [s.numel() for s in shards], _state_tensors(optimizer)
        offload.policy = settings["policy"]
        store.measure(True)  # the warm-up step: checked by check_warmup before its optimizer step
        store.record(2)  # the warm-up step and the next: the uses the dry run replays from then on
        return offload

    def check_plan(self, budget: int | None) -> None:
        """The dry run over this rank's real chunks under ``budget`` on the compute tier
        (the other tiers as they are): a replay of the uses the steps so far recorded
        (``TieredStore.record``), or, before the first step has ended, of the uses
        ``engine_log`` makes in chunk order."""
        from tessera.memory.dry_run import engine_log, whole_steps

        whole, numels, states = self.layout
        log = self.store.log
        if not whole_steps(log):
            _, _, prefetch = self.in_flight
            log = engine_log(whole, numels, state_tensors=states, clip=False, prefetch=prefetch)
        tiers = {t.name: t.budget for t in self.store.tiers}
        tiers[self.store.tiers[0].name] = budget
        _dry_run(
            self.store.manager, log, numels, policy=self.policy, device=self.store.tiers[0].device,
            device_memory=tiers.get("device"), host_memory=tiers.get("host"),
            disk=self.store.disk is not None, budget_name=self.budget_name,
        )  # fmt: skip

    def check_warmup(self) -> None:
        """After the warm-up step's forward and backward, before its optimizer step: what
        that step needed at once (whole chunks gathered for compute, the shards they came
        from, gradient shards: measured, which the dry run cannot know, e.g. a tied
        embedding's chunk kept whole from the first module to the last) fits each tier, or
        a refusal with the numbers while the parameters are still unchanged. From then on
        every step makes the same uses, so no step fails for want of a placement."""
        if not self.store.measuring:
            return
        self.store.measure(False)
        short = self.store.shortfall()
        if short is not None:
            tier, held, what = short
            name = f"{tier.name}_memory"
            raise ValueError(
                f"Plan.{name}={tier.budget} bytes: the warm-up step needed {held} bytes of chunks in use at once "
                f"on the {tier.name} tier (at {what}); refused before the first optimizer step (parameters "
                f"unchanged): raise Plan.{name} to at least {held} or lower Plan.chunk_mib"
            )

    def set_budget(self, nbytes: int) -> None:
        """A new compute-tier budget between steps (e.g. once setup's leftovers are known),
        refused like the plan's: below what the largest chunk's use needs, or where the
        dry run cannot place a step."""
        _check_need(self.budget_name, nbytes, self.need)
        _check_in_flight(self.budget_name, nbytes, *self.in_flight)
        self.check_plan(nbytes)
        self.store.set_budget(nbytes)

    def step(self, comm, axis: str, max_grad_norm: float | None, device) -> float | None:
        """Clip and step chunk by chunk, each where the store brings it: the arithmetic and
        order of ``ZeroEngine``'s ``grad_norm``, ``_clip`` and whole-model step."""
        self.check_warmup()
        norm = None
        n = len(self.shards)
        if max_grad_norm is not None:
            total = torch.zeros((), dtype=torch.float64, device=device)
            for i in range(n):
                total += self.grad_sq_sum(i)
            comm.all_reduce(total, axis)
            norm = self._norm(total)
            scale = clip_coefficient(norm, max_grad_norm)
            if scale is not None:
                for i in range(n):
                    self.scale_grad(i, scale)
        for i in range(n):
            self.step_chunk(i)
        self.store.end_step()
        return norm

    @staticmethod
    def _norm(total: torch.Tensor) -> float:
        return float(total.sqrt())

    def moved(self) -> dict:
        return self.store.moves.snapshot()
