"""The byte formulas of expert parallelism (``tessera.parallel.experts``), free of torch so
the planner (``tessera.plan.training``) reads the same ones the tests measure equal."""

from __future__ import annotations


def a2a_bytes(
    num_experts: int,
    sent: int,
    received: int,
    hidden: int,
    element_bytes: int = 4,
    *,
    combine_bytes: int | None = None,
    recomputed: bool = False,
) -> int:
    """All-to-all bytes one rank counts for one MoE layer in one training step (Comm's
    convention: an all-to-all counts this rank's input): ``8 E`` for the per-expert counts, the
    ``sent`` (token, expert) pairs dispatched and the ``received`` ones' outputs combined back
    forward, the same two gradients backward: ``8 E + 2 (S + R) H b``.

    ``element_bytes``: of the tokens dispatched (the block's input); ``combine_bytes``: of the
    expert outputs sent back (None: the same); each exchange's gradient goes back in its
    tensor's dtype. ``recomputed``: activation checkpointing runs the block's forward again in
    backward, counts and both forward exchanges included (``16 E + 3 (S + R) H b``)."""
    combine = element_bytes if combine_bytes is None else combine_bytes
    forward = 8 * num_experts + (sent * element_bytes + received * combine) * hidden
    backward = (received * element_bytes + sent * combine) * hidden
    return forward * (2 if recomputed else 1) + backward


def balanced_a2a_bytes_per_rank(
    num_experts: int,
    tokens: int,
    top_k: int,
    hidden: int,
    element_bytes: int = 4,
    *,
    recomputed: bool = False,
) -> int:
    """``a2a_bytes`` of one MoE layer averaged over the ranks of an ep group whose ranks hold
    ``tokens`` tokens each, dropless: each sends ``top_k x tokens`` pairs and, summed over the
    group, receives as many as it sends (exact for the mean whatever the routing)."""
    pairs = top_k * tokens
    return a2a_bytes(num_experts, pairs, pairs, hidden, element_bytes, recomputed=recomputed)
