"""What an op, or one slice of a chunked region, allocates beyond its inputs: measured on
fake tensors (no real memory, no compute).

An op is run once on the trace's fake tensors under the tensor tracker: a pre-dispatch
``matmul`` or ``einsum`` runs as several ATen ops (copies of non-contiguous operands, a
``bmm``, a reshape), and the tracker sees each of them. A chunked region's body is run the
same way, on narrowed views of its whole inputs exactly as the loop runs it, so copies that
an op makes of a *sliced* non-contiguous input (which the whole-size op did not need) are
counted too.

Some CPU kernels also copy an operand inside themselves, below the dispatcher, where no
tracker sees it. Those copies are added from a table, found by reading the resident-set
high-water mark around every ATen op of the Evoformer and GPT-2 blocks (torch 2.13, CPU):

- ``native_layer_norm`` makes a non-contiguous input contiguous first;
- the CPU flash-attention kernel makes a mask whose last dim is not unit-stride contiguous
  (a mask built from a permuted pair bias, say).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import Node
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from tessera.memory.track import TensorMemory

if TYPE_CHECKING:
    from tessera.autochunk.loops import Region

aten = torch.ops.aten


def tensors(val) -> list[torch.Tensor]:
    return [t for t in tree_leaves(val) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def kernel_copy_bytes(func, args, kwargs) -> int:
    """Bytes a CPU kernel copies inside itself (invisible at the dispatch level), per the table above."""
    if func is aten.native_layer_norm.default:
        x = args[0]
        return _nbytes(x) if x.device.type == "cpu" and not x.is_contiguous() else 0
    if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
        mask = (kwargs or {}).get("attn_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() and mask.size(-1) > 1 and mask.stride(-1) != 1:
            return _nbytes(mask)
    return 0


class ScratchMemory(TensorMemory):
    """The tensor tracker, plus the kernel-internal copies of ``kernel_copy_bytes`` at their op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        hidden = kernel_copy_bytes(func, args, kwargs)
        if hidden:
            self.peak = max(self.peak, self.current + hidden)
        return out


def _fake_mode(vals):
    return next((t.fake_mode for t in tensors(vals) if getattr(t, "fake_mode", None) is not None), None)


def op_scratch(node: Node) -> int:
    """Bytes ``node``'s op allocates inside itself beyond its outputs, at its worst moment."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    fake_mode = _fake_mode(node.meta.get("val"))
    if fake_mode is None:
        return 0

    def meta(arg):
        return arg.meta["val"] if isinstance(arg, Node) else arg

    args = torch.fx.node.map_aggregate(node.args, meta)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, meta)
    try:
        with fake_mode, ScratchMemory() as mem:
            out = node.target(*args, **kwargs)
    except Exception:  # an op fake tensors cannot run again: count no scratch
        return 0
    inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tensors((args, kwargs))}
    returned = {StorageWeakRef(t.untyped_storage()).cdata: t.untyped_storage().nbytes() for t in tensors(out)}
    kept = sum(b for k, b in returned.items() if k not in inputs)
    return max(0, mem.peak - kept)


def slice_body(region: Region, order: dict, layouts: dict) -> tuple[torch.fx.GraphModule, list]:
    """The loop body ``codegen`` generates for ``region``, and the fake values of its inputs
    (laid out in memory as ``layouts`` says for the other loops' outputs among them)."""
    from tessera.autochunk.codegen import region_module
    from tessera.autochunk.layout import laid_out

    body, sources = region_module(region, order)
    vals = [n.meta["val"] for n in sources]
    fake_mode = _fake_mode(vals)
    with fake_mode:
        vals = [
            laid_out(v, list(v.shape), layouts[n]) if n in layouts else v
            for n, v in zip(sources, vals, strict=True)
        ]
    return body, vals


def slice_peak(body: torch.fx.GraphModule, vals: list, chunk: int) -> int:
    """Peak bytes of one ``chunk``-long slice of a loop body (``slice_body``), its output
    slice included (it is live until copied into the loop's output): the body itself, run
    on fake narrowed views of the region's whole inputs. The inputs are counted outside."""
    fake_mode = _fake_mode(vals)
    assert fake_mode is not None, "a region reads at least one traced tensor"
    with fake_mode, ScratchMemory() as mem:
        piece = body(0, chunk, *vals)
    del piece
    return mem.peak
