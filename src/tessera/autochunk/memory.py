"""Activation memory of a traced graph, node by node, with some regions run in slices.

Memory is counted per storage, not per node: a view (transpose, reshape of a contiguous
tensor, a chunk of a split) shares its base's storage and costs nothing, and keeps the base
alive until the view's last use. A storage is allocated by the first node whose output
lives in it and freed after the last node that reads any tensor in it; the graph's outputs
live to the end. Placeholders (the inputs and the parameters) are the caller's and are not
counted: the estimate is the memory the forward adds on top of what the caller holds.

An op's own scratch (the operand copies ``matmul`` makes, say) is counted at its step only.

A chunked region replaces its nodes by one loop step at the position of its last node: the
loop allocates the full output, and on top of everything live at that point holds the
region's own intermediates at ``chunk / length`` of their full size (every one of them has
the chunk dimension, of the same length, by construction in ``region.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from tessera.memory.track import TensorMemory


def _tensors(val) -> list[torch.Tensor]:
    return [t for t in tree_leaves(val) if isinstance(t, torch.Tensor)]


@dataclass
class Region:
    """Nodes computed together in slices along one dim: ``dims[node]`` is each node's chunk dim."""

    end: Node
    dims: dict[Node, int]
    inputs: list[tuple[Node, int | None]]  # (node, dim) per distinct use from inside
    length: int
    chunk: int = 1
    copies: set[Node] = field(default_factory=set)  # also computed whole outside the region
    reads: dict[Node, dict[Node, int | None]] = field(default_factory=dict)  # node -> {input: dim}

    @property
    def nodes(self) -> set[Node]:
        return set(self.dims)


@dataclass
class Step:
    node: Node
    region: Region | None = None


@dataclass
class Timeline:
    """Per-step activation bytes of one schedule; ``peak`` and where it happens."""

    bytes_at: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(self.bytes_at, default=0)

    @property
    def peak_step(self) -> Step:
        return self.steps[self.bytes_at.index(self.peak)]


def _scratch(node: Node) -> int:
    """Bytes an op allocates inside itself beyond its outputs, at its worst moment.

    A pre-dispatch op such as ``matmul`` or ``einsum`` runs as several ATen ops (copies of
    non-contiguous operands, a ``bmm``, a reshape): run it once on the trace's fake tensors
    under the tensor tracker and take its peak minus what it returns. No real memory or
    compute is used."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    vals = [v for v in _tensors(node.meta.get("val"))]
    fake_mode = getattr(vals[0], "fake_mode", None) if vals else None
    if fake_mode is None:
        return 0

    def meta(arg):
        return arg.meta["val"] if isinstance(arg, Node) else arg

    args = torch.fx.node.map_aggregate(node.args, meta)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, meta)
    try:
        with fake_mode, TensorMemory() as mem:
            out = node.target(*args, **kwargs)
    except Exception:  # an op fake tensors cannot run again: count no scratch
        return 0
    returned = {
        StorageWeakRef(t.untyped_storage()).cdata: t.untyped_storage().nbytes() for t in _tensors(out)
    }
    inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in _tensors((args, kwargs))}
    kept = sum(b for k, b in returned.items() if k not in inputs)
    return max(0, mem.peak - kept)


class MemoryModel:
    """Storage-level liveness over a graph's nodes in their order."""

    def __init__(self, gm: GraphModule):
        self.nodes = [n for n in gm.graph.nodes if n.op not in ("output",)]
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.keys: dict[Node, list] = {}
        self.size: dict = {}
        baseline = set()
        for n in self.nodes:
            keys = []
            for t in _tensors(n.meta.get("val")):
                key = StorageWeakRef(t.untyped_storage()).cdata
                keys.append(key)
                self.size.setdefault(key, t.untyped_storage().nbytes())
                if n.op in ("placeholder", "get_attr"):
                    baseline.add(key)
            self.keys[n] = keys
        self.baseline = baseline
        self.born: dict = {}  # storage key -> first node producing it
        for n in self.nodes:
            for key in self.keys[n]:
                self.born.setdefault(key, n)
        self.scratch = {n: _scratch(n) for n in self.nodes}

    def new_keys(self, node: Node) -> list:
        return [k for k in dict.fromkeys(self.keys[node]) if self.born[k] is node and k not in self.baseline]

    def node_bytes(self, node: Node) -> int:
        return sum(self.size[k] for k in self.new_keys(node))

    def schedule(self, regions: list[Region]) -> list[Step]:
        copies = {n for r in regions for n in r.copies}
        inside = {n for r in regions for n in r.dims if n is not r.end and n not in copies}
        ends = {r.end: r for r in regions}
        needed = set(self.output.all_input_nodes)  # copies no plain step reads are dropped
        for n in reversed(self.nodes):
            if n in needed:
                needed.update(a for a, _ in ends[n].inputs) if n in ends else needed.update(n.all_input_nodes)
        return [
            Step(n, ends.get(n)) for n in self.nodes if n not in inside and (n not in copies or n in needed)
        ]

    def _uses(self, step: Step) -> list[Node]:
        if step.region is None:
            return list(step.node.all_input_nodes)
        return [n for n, _ in step.region.inputs]

    def timeline(self, regions: list[Region]) -> Timeline:
        steps = self.schedule(regions)
        last: dict = {}
        for i, step in enumerate(steps):
            for n in self._uses(step):
                for key in self.keys[n]:
                    last[key] = i
        for n in self.output.all_input_nodes:
            for key in self.keys[n]:
                last[key] = len(steps)
        live: dict = {}
        line = Timeline(steps=steps)
        for i, step in enumerate(steps):
            if step.region is None:
                new = {k: self.size[k] for k in self.new_keys(step.node)}
                extra = self.scratch[step.node]
            else:
                out = _tensors(step.node.meta["val"])[0]
                new = {self.keys[step.node][0]: out.numel() * out.element_size()}
                extra = self.inner_peak(step.region)
            live.update(new)
            line.bytes_at.append(sum(live.values()) + extra)
            for key in list(live):
                if last.get(key, i) <= i:
                    del live[key]
        return line

    def inner_peak(self, region: Region, chunk: int | None = None) -> int:
        """Peak bytes of one slice of the region's intermediates (its inputs are counted outside)."""
        chunk = region.chunk if chunk is None else chunk
        nodes = [n for n in self.nodes if n in region.dims]
        scale = chunk / region.length
        last: dict = {}
        for i, n in enumerate(nodes):
            for a in n.all_input_nodes:
                for key in self.keys[a]:
                    last[key] = i
        for key in self.keys[region.end]:
            last[key] = len(nodes)  # the slice is copied into the output after the last node
        live: dict = {}
        peak = 0
        for i, n in enumerate(nodes):
            for key in self.new_keys(n):
                live[key] = int(self.size[key] * scale)
            peak = max(peak, sum(live.values()) + int(self.scratch[n] * scale))
            for key in list(live):
                if last.get(key, i) <= i:
                    del live[key]
        return peak
