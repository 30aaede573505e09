"""What a training ``Plan`` needs a model for: the chunk-size check under offload and the
memory reports (the dry run over a model's real chunks). ``Plan`` itself is pure data and
lives with the planner (``tessera.plan.training_plan``); it is re-exported here."""

from __future__ import annotations

import math

from tessera.plan.training_plan import (  # noqa: F401 - re-exported
    OFFLOADS,
    PRECISIONS,
    SCHEDULES,
    SP_METHODS,
    ZERO_STAGES,
    Plan,
    parse_bytes,
)


def check_chunk_size(model, plan: Plan) -> None:
    """Under offload a chunk is the unit of every budget: a parameter larger than the chunk
    size (which would get a chunk of its own, larger than planned) is refused."""
    elems = max(1, math.ceil(plan.chunk_mib * 2**20 / 4))
    name, big = max(((n, p.numel()) for n, p in model.named_parameters()), key=lambda x: x[1])
    if big > elems:
        raise ValueError(
            f"Plan.chunk_mib={plan.chunk_mib} holds {elems} fp32 elements, below the largest parameter {name} "
            f"({big} elements, {big * 4 / 2**20:.3f} MiB); raise chunk_mib to at least that"
        )


def memory_report(model, plan: Plan, *, state_tensors: int = 2, nonmodel: int = 0, device: str | None = None):
    """The dry run of an offloaded ``plan`` for ``model`` (a model on the ``meta`` device
    will do): bytes per tier, bytes moved per step and the predicted peak of one rank
    (``tessera.memory.dry_run``); a ValueError with the numbers if nothing fits."""
    import torch

    from tessera.memory.dry_run import dry_run
    from tessera.parallel.zero import chunk_elems_for

    check_chunk_size(model, plan)
    if plan.offload is None:
        raise ValueError("memory_report plans offloaded chunks: give a Plan with offload='auto' or 'static'")
    segment_of = None
    if plan.block_chunks:
        from tessera.train.blocks import blocks_or_error

        blocks = blocks_or_error(model, "block_chunks")
        segment_of = {p: i for i, block in enumerate(blocks) for p in block.parameters()}
    return dry_run(
        [{"params": list(model.parameters())}],
        dp=plan.dp,
        chunk_elems=chunk_elems_for(plan.chunk_mib),
        policy=plan.offload,
        device=torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")),
        device_memory=plan.device_memory,
        host_memory=plan.host_memory,
        offload_dir=plan.offload_dir,
        clip=plan.max_grad_norm is not None,
        state_tensors=state_tensors,
        nonmodel=nonmodel,
        segment_of=segment_of,
        prefetch=plan.prefetch,  # the whole chunks gathered ahead, as the engine will
    )


def gpt2_memory_report(
    *,
    layers: int,
    width: int,
    heads: int,
    vocab: int,
    seq: int,
    batch: int,
    plan: Plan,
    device: str | None = None,
):
    """``memory_report`` for a GPT-2 of that shape (built on the meta device: no memory),
    with its fp32 activations estimated (``estimate_gpt2_activations``) for ``batch`` x
    ``seq`` tokens per rank."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from tessera.memory.dry_run import estimate_gpt2_activations

    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=seq)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    acts = estimate_gpt2_activations(
        layers=layers, width=width, heads=heads, vocab=vocab, batch=batch, seq=seq
    )
    return memory_report(model, plan, nonmodel=acts, device=device)
