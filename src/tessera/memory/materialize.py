"""A model's chunks made real one at a time, so set-up never holds the model twice, and a model
built on the meta device is initialised chunk by chunk where it will live (PatrickStar builds
parameters into chunks as modules are made; DeepSpeed's ``zero.Init`` partitions each module
as it is built; FSDP2 initialises a meta model after sharding).

``materialized`` gives each chunk of a lazily packed ``ChunkManager`` its storage (the
parameters' values copied in, then the chunk is their storage) and yields it once its values
are final; the caller takes its shard and may free it before the next one is made. For a model
whose parameters have no data (``tessera.boost`` swaps a meta model's parameters for ones with
empty storage), ``init(module)`` then runs on:

- every module with parameters of its own;
- every module without parameters of its own whose parameters span no more chunks than a
  block does (an element of the model's module lists, its transformer blocks): the blocks,
  their attention and MLP modules (transformers' GPT-2 re-scales ``c_proj`` from there); not
  the containers of the blocks (the model itself, its list of blocks), which would need every
  chunk real at once,

each once all of its parameters are real, in post-order (children first, as
``nn.Module.apply`` and transformers' ``post_init`` go). A chunk is yielded once every such
module with parameters in it has run, so about two blocks' chunks are real at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from tessera.memory.chunk_manager import ChunkManager, ParamChunk


def default_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """A transformers model's own ``_init_weights`` (what ``post_init`` runs per module), else
    each module's ``reset_parameters`` (torch's layers)."""
    if callable(getattr(model, "_init_weights", None)):
        return model._init_weights

    def reset(module: nn.Module) -> None:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    return reset


def uninitialisable(model: nn.Module) -> str | None:
    """The first module (by name) with parameters of its own that ``default_init`` cannot
    initialise (no ``reset_parameters``), for a model that is not a transformers one."""
    if callable(getattr(model, "_init_weights", None)):
        return None
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)) and not hasattr(module, "reset_parameters"):
            return name or type(module).__name__
    return None


def materialized(
    manager: ChunkManager, model: nn.Module, init: Callable[[nn.Module], None] | None
) -> Iterator[ParamChunk]:
    """Each chunk of ``manager`` made real in order and yielded once its values are final
    (``init``: None for a model with data, else run on its modules as the module doc says)."""
    if init is None:
        for cg in manager.chunks:
            cg.materialize()
            yield cg
        return
    owner = manager.owner
    modules = _post_order(model)
    own = {m: {owner[p] for p in m.parameters(recurse=False) if p in owner} for m in modules}
    under = {m: {owner[p] for p in m.parameters() if p in owner} for m in modules}
    elements = [c for m in modules if isinstance(m, nn.ModuleList) for c in m]
    block = max([len(under[m]) for m in elements] + [len(own[m]) for m in modules], default=1)
    modules = [m for m in modules if under[m] and (own[m] or len(under[m]) <= block)]
    needs = {cg: [m for m in modules if cg in under[m]] for cg in manager.chunks}
    done: set[nn.Module] = set()
    real: set[ParamChunk] = set()
    open_: list[ParamChunk] = []
    for cg in manager.chunks:
        cg.materialize()
        real.add(cg)
        open_.append(cg)
        for m in modules:
            if m not in done and under[m] <= real:
                with torch.no_grad():
                    init(m)
                done.add(m)
        ready = [c for c in open_ if all(m in done for m in needs[c])]
        open_ = [c for c in open_ if c not in ready]
        yield from ready
    assert not open_, "every chunk's modules are initialised once every chunk is real"


def _post_order(model: nn.Module) -> list[nn.Module]:
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        order.append(m)

    visit(model)
    return order
