"""A model built on the meta device, trained without ever being whole in memory.

Build it with its parameters on the meta device and its buffers real (accelerate's
``init_empty_weights()``, the way transformers and accelerate load big models), then boost it
at ZeRO 1-3::

    with accelerate.init_empty_weights():
        model = GPT2LMHeadModel(config)
    model.tie_weights()  # transformers ties the embeddings after loading; accelerate's docs do it here
    model, optimizer = tessera.boost(model, torch.optim.AdamW(model.parameters()), tessera.Plan(zero=3))

``boost`` swaps each meta parameter for one of the same shape on the mesh's device with empty
storage (``empty_parameters``), and the ZeRO core makes the chunks real one at a time, running
``init`` on the modules of each (``tessera.memory.materialize``: a transformers model's own
``_init_weights``, else each layer's ``reset_parameters``), broadcast from dp-rank 0, sharded
and, at ZeRO-3, freed before the next chunk is made. Set-up then holds one chunk or so beyond
the rank's shards, not the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera.memory.materialize import default_init, uninitialisable


def check_meta(model: nn.Module, plan, init: Callable[[nn.Module], None] | None):
    """None for a model with data (``init`` must then be None); for a model on the meta device,
    the init to run (``init`` or the default), or a ValueError naming what cannot be done."""
    named = list(model.named_parameters())
    meta = [n for n, p in named if p.is_meta]
    if not meta:
        if init is not None:
            raise ValueError(
                "boost(init=...) initialises a model built on the meta device; this model has data"
            )
        return None
    real = [n for n, p in named if not p.is_meta]
    if real:
        raise ValueError(
            f"parameter {meta[0]} is on the meta device and {real[0]} is not: build every parameter "
            "on the meta device (accelerate.init_empty_weights()) or none"
        )
    buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if buffers:
        raise ValueError(
            f"buffer {buffers[0]} is on the meta device (its values are lost): build the model under "
            "accelerate.init_empty_weights(), which keeps buffers real"
        )
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and callable(
        getattr(model, "get_output_embeddings", None)
    ):
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and inp is not None and out.weight is not inp.weight:
            raise ValueError(
                "the model's config ties its output embedding to its input embedding, but on the meta device "
                "they are two parameters: call model.tie_weights() before building the optimizer"
            )
    frozen = [n for n, p in named if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"parameter {frozen[0]} is on the meta device and frozen: only trained parameters are made"
        )
    others = {k: getattr(plan, k) for k in ("tp", "pp", "sp", "ep") if getattr(plan, k) > 1}
    if plan.zero < 1 or others:
        what = ", ".join(f"{k}={v}" for k, v in others.items()) or f"zero={plan.zero}"
        raise ValueError(
            f"a model on the meta device is made chunk by chunk by the ZeRO core: Plan(zero=1..3) with "
            f"data parallelism only, not Plan({what})"
        )
    if init is None:
        missing = uninitialisable(model)
        if missing is not None:
            raise ValueError(
                f"module {missing} has parameters on the meta device and no reset_parameters(): pass "
                "boost(..., init=fn), fn(module) initialising a module's parameters in place"
            )
        init = default_init(model)
    return init


def empty_parameters(model: nn.Module, device: torch.device) -> None:
    """Each meta parameter replaced (in every module holding it: tied ones stay tied) by a
    parameter of its shape and dtype on ``device`` with empty storage, for a chunk to become."""
    new: dict[nn.Parameter, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if p not in new:
                t = torch.empty(p.shape, dtype=p.dtype, device=device)
                t.untyped_storage().resize_(0)
                new[p] = nn.Parameter(t, requires_grad=p.requires_grad)
            module._parameters[name] = new[p]
