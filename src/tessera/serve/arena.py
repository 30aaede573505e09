"""Making a forward use the memory plan: every activation a planned op produces is
written (through the op's ``out=`` overload) into its place in arena chunks that live
across batches, so in steady state a batch asks the allocator for nothing.

TurboTransformers writes the tensor usage records of a BERT layer by hand as functions of
batch size and sequence length (`bert_config.cpp`). Here they are read off the code that
runs: the forward is traced at three small probe batches (ATen dispatch: each op, each
new storage it makes, when that storage dies), and every dimension of every activation
is solved as ``a * X + c`` for X one of the batch's token count T, input count B, longest
input L or B x L, checked on the third probe. A batch of any shape then gets its usage
records by arithmetic, its placement from `memory_plan.plan_memory` (cached per shape),
and runs under `_Replay`, which hands each planned op its views. The same op sequence at
every shape is required (so attention must not loop over inputs: the ``padded`` split);
a divergence, or an op whose result does not land where planned, is counted and the rest
of that forward runs on the allocator, correct but unplanned.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tessera.serve.memory_plan import MemoryPlan, Usage, peak_live_bytes, plan_memory

PROBES = ([3, 8], [5, 6, 12], [2, 9, 4, 14, 7])  # T, B, L, BxL affinely independent over these
VARIABLES = ("T", "B", "L", "BL")
# A batch's chunks may hold at most this much over its peak of live bytes (the aim;
# TurboTransformers' greedy-by-size lands at 1.10-1.16 from nothing on BERT layers).
FOOTPRINT_TARGET = 1.2


def signature(lengths: list[int]) -> dict[str, int]:
    return {"T": sum(lengths), "B": len(lengths), "L": max(lengths), "BL": len(lengths) * max(lengths)}


def _out_overload(func):
    """The ``out=`` overload of ``func`` taking the same arguments, and its out names."""
    packet, name = func.overloadpacket, func._overloadname
    want = [(a.name, str(a.type)) for a in func._schema.arguments]
    for candidate in (f"{name}_out", "out"):
        if candidate not in packet.overloads():
            continue
        op = getattr(packet, candidate)
        args = op._schema.arguments
        outs = [a.name for a in args if a.alias_info is not None and a.alias_info.is_write and a.kwarg_only]
        ins = [(a.name, str(a.type)) for a in args if a.name not in outs]
        if ins == want and len(outs) == len(func._schema.returns):
            return op, outs
    return None


def _canonical(func, args, kwargs):
    """An op without an ``out=`` overload run as an equivalent one that has it: ``(func,
    args, kwargs, pick)``, ``pick`` the output to hand back (None: all of them). torch 2.13
    dispatches ``layer_norm`` whole on CPU; ``native_layer_norm`` computes it (plus the
    mean and rstd rows, which are planned too and die at once)."""
    if func is torch.ops.aten.layer_norm.default:
        names = ("input", "normalized_shape", "weight", "bias", "eps")
        defaults = {"weight": None, "bias": None, "eps": 1e-5}
        bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
        values = [bound.get(n, defaults.get(n)) for n in names]
        return torch.ops.aten.native_layer_norm.default, tuple(values), {}, 0
    return func, args, kwargs, None


def _picked(out, pick):
    return out if pick is None else out[pick]


@dataclass
class Site:
    op_index: int
    output: int
    dtype: torch.dtype
    dims: list  # per dim: (variable or None, a, c)
    first: int
    last: int

    def shape(self, sig: dict[str, int]) -> tuple[int, ...]:
        return tuple(int(a * (sig[v] if v else 0) + c) for v, a, c in self.dims)

    def nbytes(self, sig: dict[str, int]) -> int:
        return torch.Size(self.shape(sig)).numel() * self.dtype.itemsize


@dataclass
class Trace:
    ops: list[str]
    sites: list[Site]
    unplanned_ops: list[str] = field(default_factory=list)  # allocating ops without an out= overload


class _Recorder(TorchDispatchMode):
    """Every op, and every new storage an op makes with its shape and lifetime."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.raw: list[dict] = []
        self.unplanned: list[str] = []
        self._live: dict[int, tuple[StorageWeakRef, dict]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        func, args, kwargs, pick = _canonical(func, args, kwargs or {})
        index = len(self.ops)
        for key, (ref, record) in list(self._live.items()):
            if ref.expired():
                record["last"] = index - 1
                del self._live[key]
        self.ops.append(str(func))
        out = func(*args, **kwargs)
        seen = {
            StorageWeakRef(t.untyped_storage()).cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        new = [StorageWeakRef(t.untyped_storage()) for t in tensors]
        fresh = [ref.cdata not in seen and ref.cdata not in self._live for ref in new]
        if not any(fresh):
            return _picked(out, pick)  # a view or an in-place op: nothing allocated
        if _out_overload(func) is None or not all(fresh) or not all(t.is_contiguous() for t in tensors):
            self.unplanned.append(str(func))
            return _picked(out, pick)
        for pos, (t, ref) in enumerate(zip(tensors, new, strict=True)):
            record = {"op": index, "pos": pos, "dtype": t.dtype, "shape": tuple(t.shape), "last": None}
            self.raw.append(record)
            self._live[ref.cdata] = (ref, record)
        return _picked(out, pick)

    def finish(self) -> None:
        for _, record in self._live.values():
            record["last"] = len(self.ops)  # alive when the forward returned


def record(prepare: Callable, compute: Callable, lengths: list[int]) -> _Recorder:
    recorder = _Recorder()
    with torch.inference_mode():
        inputs = prepare([[5] * n for n in lengths])
        with recorder:
            result = compute(inputs)
            recorder.finish()
    del result
    return recorder


def _solve(values: list[int], sigs: list[dict[str, int]]):
    if len(set(values)) == 1:
        return (None, 0, values[0])
    for var in VARIABLES:
        xs = [s[var] for s in sigs]
        if xs[1] == xs[0]:
            continue
        a = Fraction(values[1] - values[0], xs[1] - xs[0])
        c = values[0] - a * xs[0]
        if all(a * x + c == v for x, v in zip(xs, values, strict=True)):
            return (var, a, c)
    raise ValueError(
        f"an activation dimension {values} at probe shapes is not affine in {', '.join(VARIABLES)}"
    )


def derive_trace(prepare: Callable, compute: Callable) -> Trace:
    """Record ``compute(prepare(batch))`` at the probes and solve every planned activation's shape."""
    recorders = [record(prepare, compute, lengths) for lengths in PROBES]
    sigs = [signature(lengths) for lengths in PROBES]
    first = recorders[0]
    for other in recorders[1:]:
        if other.ops != first.ops or len(other.raw) != len(first.raw):
            raise ValueError("the forward runs different ops at different batch shapes: it cannot be planned")
    sites = []
    for records in zip(*(r.raw for r in recorders), strict=True):
        shapes = [r["shape"] for r in records]
        if len({len(s) for s in shapes}) != 1:
            raise ValueError(f"an activation changes rank with the batch shape: {shapes}")
        dims = [_solve([s[d] for s in shapes], sigs) for d in range(len(shapes[0]))]
        lasts = {r["last"] - r["op"] for r in records}
        head = records[0]
        assert len(lasts) == 1, "an activation's lifetime depends on the batch shape"
        sites.append(Site(head["op"], head["pos"], head["dtype"], dims, head["op"], head["last"]))
    return Trace(first.ops, sites, sorted(set(first.unplanned)))


class _Replay(TorchDispatchMode):
    def __init__(self, trace: Trace, views: dict[tuple[int, int], torch.Tensor], stats: dict):
        super().__init__()
        self.trace, self.views, self.stats = trace, views, stats
        self.index, self.diverged = 0, False
        self.by_op: dict[int, list[int]] = {}
        for op, pos in views:
            self.by_op.setdefault(op, []).append(pos)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        func, args, kwargs, pick = _canonical(func, args, kwargs or {})
        k, self.index = self.index, self.index + 1
        if not self.diverged and (k >= len(self.trace.ops) or self.trace.ops[k] != str(func)):
            self.diverged = True
            self.stats["diverged"] += 1
        positions = None if self.diverged else self.by_op.get(k)
        if positions is None:
            out = func(*args, **kwargs)
            self._count_allocations(args, kwargs, out)
            return _picked(out, pick)
        op, names = _out_overload(func)
        outs = [self.views[k, p] for p in sorted(positions)]  # every output of this op is planned
        result = op(*args, **kwargs, **dict(zip(names, outs, strict=True)))
        for got, want in zip(
            [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)], outs, strict=True
        ):
            if got.data_ptr() != want.data_ptr():  # resized away from its place: the plan was wrong here
                self.stats["misplaced"] += 1
        return _picked(result, pick)

    def _count_allocations(self, args, kwargs, out) -> None:
        """An unplanned op that made a new storage asked the allocator: counted, so that
        "nothing allocated in steady state" is a measurement."""
        seen = {
            StorageWeakRef(t.untyped_storage()).cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()).cdata not in seen:
                self.stats["allocations"] += 1
                self.stats["allocated_bytes"] += t.untyped_storage().nbytes()


class Arena:
    """Chunks held across batches, a plan per batch shape, a forward run inside them."""

    def __init__(
        self,
        prepare: Callable,
        compute: Callable[..., torch.Tensor],
        *,
        keep_plans: int = 8,
        target: float = FOOTPRINT_TARGET,
        window: int = 256,
    ):
        self.prepare, self.compute, self.target = prepare, compute, target
        self.trace = derive_trace(prepare, compute)
        self.chunks: list[torch.Tensor] = []
        self._last_use: list[int] = []
        self._plans: dict[tuple, MemoryPlan] = {}
        self.keep_plans = keep_plans
        self._peaks: deque[int] = deque(maxlen=window)  # peak live bytes of the last batches
        counters = (
            "batches",
            "plans",
            "plans_anew",
            "chunk_allocations",
            "chunk_releases",
            "diverged",
            "misplaced",
            "allocations",  # storages unplanned ops made inside a planned forward
            "allocated_bytes",
        )
        self.stats = dict.fromkeys(counters, 0)
        self.last_plan: MemoryPlan | None = None

    def usages(self, sig: dict[str, int]) -> list[Usage]:
        return [Usage(s.nbytes(sig), s.first, s.last) for s in self.trace.sites]

    def usages_peak(self, lengths: list[int]) -> int:
        """The peak of live bytes a batch of these input lengths needs (the bound on any plan)."""
        return peak_live_bytes(self.usages(signature(lengths)))

    def plan(self, lengths: list[int]) -> MemoryPlan:
        if self._peaks:
            self._release_idle()  # the last batch's forward is done with its chunks
        sig = signature(lengths)
        key = tuple(sig.values())
        plan = self._plans.get(key)
        if plan is None:
            # into the chunks held (they cost nothing more), new ones only for what does not fit
            usages = self.usages(sig)
            plan = plan_memory(usages, [c.numel() for c in self.chunks])
            if plan.new_chunks and plan.peak_live >= max(self._peaks, default=0):
                # the largest batch yet does not fit what is held: the held set is cut again
                # from nothing, for it (smaller batches then mostly fit inside)
                self._release([*range(len(self.chunks))])
                plan = plan_memory(usages)
                self.stats["plans_anew"] += 1
            for size in plan.chunk_sizes[len(self.chunks) :]:
                self.chunks.append(torch.empty(size, dtype=torch.uint8))
                self._last_use.append(0)
                self.stats["chunk_allocations"] += 1
            self._plans[key] = plan
            self.stats["plans"] += 1
        self.stats["batches"] += 1
        self._peaks.append(plan.peak_live)
        for c in plan.used_chunks:
            self._last_use[c] = self.stats["batches"]
        self.last_plan = plan
        return plan

    def run(self, sequences: list[list[int]]) -> torch.Tensor:
        lengths = [len(s) for s in sequences]
        plan = self.plan(lengths)
        sig = signature(lengths)
        views = {}
        for site, (chunk, offset) in zip(self.trace.sites, plan.placements, strict=True):
            nbytes = site.nbytes(sig)
            views[site.op_index, site.output] = (
                self.chunks[chunk][offset : offset + nbytes].view(site.dtype).view(site.shape(sig))
            )
        inputs = self.prepare(sequences)
        with _Replay(self.trace, views, self.stats):
            out = self.compute(inputs)
        return out.clone()  # the batch's answer must outlive the chunks' next use

    def _release_idle(self) -> None:
        """While the chunks held exceed ``target`` x the largest peak of live bytes among the
        last ``window`` batches, the least recently used chunk idle for ``keep_plans``
        batches goes back (and every cached plan with them: plans index chunks by position)."""
        limit = self.target * max(self._peaks)
        held = self.held_bytes()
        if held <= limit:
            return
        now = self.stats["batches"]
        idle = sorted(
            (c for c, used in enumerate(self._last_use) if now - used >= self.keep_plans),
            key=lambda c: self._last_use[c],
        )
        drop = set()
        for c in idle:
            if held <= limit:
                break
            drop.add(c)
            held -= self.chunks[c].numel()
        self._release(drop)

    def _release(self, chunks) -> None:
        if not chunks:
            return
        keep = [c for c in range(len(self.chunks)) if c not in set(chunks)]
        self.chunks = [self.chunks[c] for c in keep]
        self._last_use = [self._last_use[c] for c in keep]
        self._plans.clear()
        self.stats["chunk_releases"] += len(chunks)

    def held_bytes(self) -> int:
        return sum(c.numel() for c in self.chunks)
