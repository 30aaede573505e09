"""Losses the recipes, benchmarks and tests share.

A loss is called as ``loss_fn(model, batch)``. Pipeline and sequence parallel plans cannot
call the whole model on the whole batch, so a loss that supports them says how it splits:
``pipeline_parts(batch)`` gives the first stage's inputs and the target the last stage
sees, ``on_output(output, target)`` the micro-batch's mean loss from the last stage's
output; ``sequence_parallel(sp, batch)`` the global mean loss through a
``tessera.parallel.sequence.SequenceParallel``. The three protocols below name these
(``TrainLoss``, ``PipelineLoss``, ``SequenceLoss``); ``causal_lm_loss`` is all three, so the
same training code runs under every plan.

A causal-LM batch with padding (a dict with ``input_ids`` and ``attention_mask``) has rows
of different lengths, so a mean per micro-batch averaged over micro-batches and replicas
is not the mean over the batch's tokens. A loss that can count its items says so with
``token_count(batch)`` (None when every micro-batch holds the same number), and takes
``denominator=``: the plans then divide each micro-batch's summed loss by the global count
(scaled by the number of micro-batches the plan averages), which makes every plan's loss
and gradients those of one process on the whole batch.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from tessera.parallel.lm_batch import next_token_labels, token_batch


@runtime_checkable
class TrainLoss(Protocol):
    """What ``TrainOptimizer.train_step`` calls: ``loss_fn(model, micro_batch)``, the
    micro-batch's mean loss. Any such callable serves dp and tp (and ZeRO, offload, ep)."""

    def __call__(self, model: nn.Module, batch) -> torch.Tensor: ...


@runtime_checkable
class PipelineLoss(Protocol):
    """A loss that splits over pipeline stages (``Plan(pp > 1)``): the first stage's inputs
    and the last stage's target from a batch, and the loss from the last stage's output."""

    def pipeline_parts(self, batch) -> tuple: ...

    def on_output(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class SequenceLoss(Protocol):
    """A loss that splits each sequence over ranks (``Plan(sp > 1)``): the global mean loss
    through a ``tessera.parallel.sequence.SequenceParallel``."""

    def sequence_parallel(self, sp, batch, *, denominator: float | None = None) -> torch.Tensor: ...


class CausalLMLoss:
    """Mean next-token cross-entropy of a HuggingFace causal LM on a batch of ``tokens`` (B, S),
    or on a dict with ``input_ids`` and ``attention_mask`` (padding: a position counts when
    it and the next are tokens; ``tessera.parallel.sequence.next_token_labels``). Works on
    vocabulary-sharded logits (a DTensor) under ``loss_parallel``."""

    def __call__(self, model: nn.Module, batch, *, denominator: float | None = None) -> torch.Tensor:
        ids, mask = token_batch(batch)
        if mask is None and denominator is None:
            return self.on_output(model(input_ids=ids).logits, ids)
        logits = model(input_ids=ids, attention_mask=mask).logits
        return label_loss(logits, next_token_labels(ids, mask), denominator)

    def token_count(self, batch) -> int | None:
        """Labelled positions in ``batch`` when it is padded (None: every row is whole)."""
        ids, mask = token_batch(batch)
        return None if mask is None else int((next_token_labels(ids, mask) != -100).sum())

    def pipeline_parts(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = token_batch(batch)
        return ids, (ids if mask is None else next_token_labels(ids, mask))

    def on_output(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
        )

    def sequence_parallel(self, sp, batch, *, denominator: float | None = None) -> torch.Tensor:
        return sp.loss(batch, denominator=denominator)

    def __repr__(self) -> str:
        return "causal_lm_loss"


def label_loss(logits: torch.Tensor, labels: torch.Tensor, denominator: float | None = None) -> torch.Tensor:
    """Cross-entropy over the positions whose label is not -100: their mean, or their sum
    over ``denominator``."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    if denominator is None:
        return nn.functional.cross_entropy(flat, labels.reshape(-1))
    return nn.functional.cross_entropy(flat, labels.reshape(-1), reduction="sum") / denominator


class LabelLoss:
    """The last pipeline stage's loss on (logits, labels) made by ``pipeline_parts`` of a
    padded batch (or by a sequence split): summed cross-entropy over ``denominator``."""

    def __init__(self, denominator: float):
        self.denominator = denominator

    def on_output(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return label_loss(logits, labels, self.denominator)


causal_lm_loss = CausalLMLoss()


class MSELoss:
    """Mean squared error of ``model(*inputs)`` against ``target`` for a batch
    ``(*inputs, target)`` (e.g. a DiT's (x_t, t, y, velocity)); splits over pipeline stages."""

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        inputs, target = self.pipeline_parts(batch)
        return self.on_output(model(*inputs), target)

    def pipeline_parts(self, batch) -> tuple[tuple, torch.Tensor]:
        *inputs, target = batch
        return tuple(inputs), target

    def on_output(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output.float(), target)

    def __repr__(self) -> str:
        return "mse_loss"


mse_loss = MSELoss()
