"""Activation memory of a traced graph, node by node, with some regions run in slices.

Memory is counted per storage, not per node: a view (transpose, reshape of a contiguous
tensor, a chunk of a split) shares its base's storage and costs nothing, and keeps the base
alive until the view's last use. A storage is allocated by the first node whose output
lives in it and freed after the last node that reads any tensor in it; the graph's outputs
live to the end. Placeholders (the inputs and the parameters) are the caller's and are not
counted: the estimate is the memory the forward adds on top of what the caller holds.

An op's own scratch (the operand copies ``matmul`` makes, say) is counted at its step only.

A chunked region replaces its nodes by one loop step at the position of its last node: the
loop allocates the full output, and on top of everything live at that point holds one
slice of the region's intermediates. While regions are searched for, a slice is costed at
``chunk / length`` of the intermediates' full size (every one of them has the chunk
dimension, of the same length, by construction in ``region.py``); the slices finally chosen
are costed by running the loop body on fake tensors (``scratch.slice_peak``), which also
sees the copies ops make of sliced non-contiguous inputs.

A loop writes into an input's storage instead of a new output when that input is read only
in slices along the loop's dim, has the output's shape, dtype and contiguous layout, owns
its storage, and is read by nothing after the loop: slice ``i`` of the input is read before
slice ``i`` of the output overwrites it, and no later slice reads it again. That saves one
output-sized tensor (the residual stream's, in a residual block). It is done only when
autograd is off (saved slices would be overwritten), which is what the estimate describes:
the forward's activation memory without autograd's saved tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

from tessera.autochunk.loops import Region
from tessera.autochunk.scratch import op_scratch, slice_body, slice_peak
from tessera.autochunk.scratch import tensors as _tensors


@dataclass
class Step:
    node: Node
    region: Region | None = None


@dataclass
class Timeline:
    """Per-step activation bytes of one schedule; ``peak`` and where it happens."""

    bytes_at: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    into: dict[Node, Node] = field(default_factory=dict)  # region end -> input it writes into

    @property
    def peak(self) -> int:
        return max(self.bytes_at, default=0)

    @property
    def peak_step(self) -> Step:
        return self.steps[self.bytes_at.index(self.peak)]


def _same_rows(view, dim: int | None, base, d: int) -> bool:
    """Whether slice ``[s, s+n)`` of ``view`` along ``dim`` is exactly slice ``[s, s+n)`` of
    ``base`` (contiguous, same storage) along ``d``: ``view`` is ``base`` with its dims permuted."""
    if dim is None or not isinstance(view, torch.Tensor) or view.storage_offset() != 0:
        return False
    layout = sorted(zip(view.stride(), view.shape, strict=True))
    same = layout == sorted(zip(base.stride(), base.shape, strict=True))
    return same and view.stride(dim) == base.stride(d) and view.shape[dim] == base.shape[d]


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
        self._new_keys = {
            n: [k for k in dict.fromkeys(self.keys[n]) if self.born[k] is n and k not in baseline]
            for n in self.nodes
        }
        self.scratch = {n: op_scratch(n) for n in self.nodes}
        self._slice_peaks: dict = {}
        self._bodies: dict = {}

    def new_keys(self, node: Node) -> list:
        """The storages ``node`` allocates (not views of earlier ones, not the caller's)."""
        return self._new_keys[node]

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

    def timeline(self, regions: list[Region], *, measured: bool = False) -> Timeline:
        """Bytes at every step; a loop's slice is costed by scaling (``measured=False``, for
        the search) or by running its body on fake tensors (``measured=True``)."""
        steps = self.schedule(regions)
        last: dict = {}
        for i, step in enumerate(steps):
            for n in self._uses(step):
                for key in self.keys[n]:
                    last[key] = i
        for n in self.output.all_input_nodes:
            for key in self.keys[n]:
                last[key] = len(steps)
        layouts = {r.end: r.layout for r in regions if r.layout is not None}
        alias: dict = {}  # a loop output's storage -> the input storage it is written into
        live: dict = {}
        line = Timeline(steps=steps)
        for i, step in enumerate(steps):
            if step.region is None:
                new = {k: self.size[k] for k in self.new_keys(step.node)}
                extra = self.scratch[step.node]
            else:
                key = self.keys[step.node][0]
                into = self._writable_input(step.region, i, last, alias)
                if into is None:
                    out = _tensors(step.node.meta["val"])[0]
                    new = {key: out.numel() * out.element_size()}
                else:
                    alias[key] = self._resolve(self.keys[into][0], alias)
                    last[alias[key]] = last.get(key, i)
                    line.into[step.node] = into
                    new = {}
                if measured:
                    extra = self.slice_bytes(step.region, layouts=layouts)
                else:
                    extra = self.inner_peak(step.region)
            live.update(new)
            line.bytes_at.append(sum(live.values()) + extra)
            for key in list(live):
                if last.get(key, i) <= i:
                    del live[key]
        return line

    @staticmethod
    def _resolve(key, alias: dict):
        while key in alias:
            key = alias[key]
        return key

    def _writable_input(self, region: Region, i: int, last: dict, alias: dict) -> Node | None:
        """An input of the loop at step ``i`` it can write its output into (module docstring), or None."""
        out = _tensors(region.end.meta["val"])[0]
        d = region.dims[region.end]
        for node, dim in region.inputs:
            val = node.meta.get("val")
            if (
                dim != d
                or node.op != "call_function"
                or not isinstance(val, torch.Tensor)
                or len(self.keys[node]) != 1
                or val.shape != out.shape
                or val.dtype != out.dtype
                or not val.is_contiguous()
                or val.storage_offset() != 0
                or val.untyped_storage().nbytes() != out.numel() * out.element_size()
            ):
                continue
            key = self._resolve(self.keys[node][0], alias)
            if key in self.baseline or last.get(key, -1) != i:
                continue
            sharing = [
                (n, e) for n, e in region.inputs if any(self._resolve(k, alias) == key for k in self.keys[n])
            ]
            if all(_same_rows(n.meta["val"], e, val, d) for n, e in sharing):
                return node
        return None

    def slice_bytes(self, region: Region, chunk: int | None = None, *, layouts: dict | None = None) -> int:
        """``scratch.slice_peak`` of the region at ``chunk`` (default its own), cached; ``layouts``:
        the memory orders of other loops' outputs it reads (``layout.py``)."""
        chunk = region.chunk if chunk is None else chunk
        layouts = {n: o for n, o in (layouts or {}).items() if any(n is a for a, _ in region.inputs)}
        key = (
            region.end,
            frozenset(region.dims.items()),
            frozenset(region.copies),
            frozenset(layouts.items()),
        )
        if key not in self._bodies:
            self._bodies[key] = slice_body(region, self.order, layouts)
        if (key, chunk) not in self._slice_peaks:
            self._slice_peaks[key, chunk] = slice_peak(*self._bodies[key], chunk)
        return self._slice_peaks[key, chunk]

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
