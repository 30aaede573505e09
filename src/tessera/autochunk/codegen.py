"""Rewrite the traced graph: each chunked region becomes one loop over slices.

The region's nodes move into their own small ``GraphModule`` that takes ``(start, length,
*inputs)``, narrows each input it reads along that input's chunk dim, and rewrites the one
entry of a size list (``view``, ``reshape``, ``expand``) that names the chunked dim to
``length``. A ``ChunkLoop`` module runs it over ``range(0, length, chunk)`` and copies each
slice into the output, which is allocated once (in the memory order ``layout.py`` chose, or
into a dying input's storage: ``memory.py``). In the main graph the loop takes the place
of the region's last node, so ``print(chunked.graph_module.code)`` shows where each loop runs
and ``print(chunked.graph_module.chunk_loop_0.region.code)`` what it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from tessera.autochunk.layout import laid_out
from tessera.autochunk.rules import SIZE_LIST_OPS

if TYPE_CHECKING:
    from tessera.autochunk.loops import Region


class ChunkLoop(nn.Module):
    """Run ``region(start, n, *inputs)`` over slices of ``chunk`` along ``dim`` of ``length``.

    With ``into`` (an input's position) and autograd off, the slices are written into that
    input's storage (``memory.py`` says when the planner allows it: the input is read only in
    the same slices, before they are overwritten, and by nothing after the loop)."""

    def __init__(
        self,
        region: fx.GraphModule,
        dim: int,
        length: int,
        chunk: int,
        into: int | None = None,
        layout: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.region, self.dim, self.length, self.chunk = region, dim, length, chunk
        self.into, self.layout = into, layout

    def _buffer(self, piece: torch.Tensor, inputs) -> torch.Tensor:
        shape = list(piece.shape)
        shape[self.dim] = self.length
        if self.into is not None and not torch.is_grad_enabled():
            target = inputs[self.into]
            if list(target.shape) == shape and target.dtype == piece.dtype and target.is_contiguous():
                return target
        return laid_out(piece, shape, self.layout)

    def forward(self, *inputs):
        out = None
        for start in range(0, self.length, self.chunk):
            n = min(self.chunk, self.length - start)
            piece = self.region(start, n, *inputs)
            if out is None:
                out = self._buffer(piece, inputs)
            out.narrow(self.dim, start, n).copy_(piece)
            del piece  # else it lives on while the next slice is computed
        return out

    def extra_repr(self) -> str:
        into = "" if self.into is None else f", into=input {self.into}"
        layout = "" if self.layout is None else f", layout={self.layout}"
        return f"dim={self.dim}, length={self.length}, chunk={self.chunk}{into}{layout}"


def region_module(region: Region, order: dict) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The region's nodes as a GraphModule over (start, length, *distinct input nodes)."""
    graph = fx.Graph()
    start, length = graph.placeholder("start"), graph.placeholder("length")
    sources = list(dict.fromkeys(node for node, _ in region.inputs))
    held = {node: graph.placeholder(node.name) for node in sources}
    sliced: dict[tuple[fx.Node, int], fx.Node] = {}
    env: dict[fx.Node, fx.Node] = {}

    for node in sorted(region.dims, key=order.__getitem__):
        per_arg = region.reads[node]

        def mapped(arg, per_arg=per_arg):
            if arg in env:
                return env[arg]
            dim = per_arg.get(arg)
            if dim is None:
                return held[arg]
            key = (arg, dim)
            if key not in sliced:
                sliced[key] = graph.call_function(torch.narrow, (held[arg], dim, start, length))
            return sliced[key]

        new = graph.node_copy(node, mapped)
        if node.target in SIZE_LIST_OPS:
            sizes = list(new.args[1])
            d = region.dims[node]
            if sizes[d] != -1:
                sizes[d] = length
            new.args = (new.args[0], sizes, *new.args[2:])
        env[node] = new
    graph.output(env[region.end])
    return fx.GraphModule(nn.Module(), graph), sources


def apply_regions(gm: fx.GraphModule, regions: list[Region], order: dict) -> fx.GraphModule:
    """Replace each region in ``gm`` (in place) by a ChunkLoop call; returns ``gm``."""
    built = [region_module(region, order) for region in regions]  # before any node is replaced
    replaced: dict[fx.Node, fx.Node] = {}
    for i, (region, (sub, sources)) in enumerate(zip(regions, built, strict=True)):
        name = f"chunk_loop_{i}"
        into = sources.index(region.into) if region.into is not None else None
        loop = ChunkLoop(sub, region.dims[region.end], region.length, region.chunk, into, region.layout)
        gm.add_submodule(name, loop)
        with gm.graph.inserting_before(region.end):
            loop = gm.graph.call_module(name, tuple(replaced.get(n, n) for n in sources))
        replaced[region.end] = loop
        loop.meta = dict(region.end.meta)
        region.end.replace_all_uses_with(loop)
        for node in sorted(region.dims, key=order.__getitem__, reverse=True):
            if node not in region.copies:
                gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()  # copies whose whole value no one outside reads any more
    gm.graph.lint()
    gm.recompile()
    return gm
