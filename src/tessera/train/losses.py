"""Losses the recipes, benchmarks and tests share.

A loss is called as ``loss_fn(model, batch)``. Pipeline and sequence parallel plans cannot
call the whole model on the whole batch, so a loss that supports them says how it splits:
``pipeline_parts(batch)`` gives the first stage's inputs and the target the last stage
sees, ``on_output(output, target)`` the micro-batch's mean loss from the last stage's
output; ``sequence_parallel(sp, batch)`` the global mean loss through a
``tessera.parallel.sequence.SequenceParallel``.
"""

from __future__ import annotations

import torch
from torch import nn


class CausalLMLoss:
    """Mean next-token cross-entropy of a HuggingFace causal LM on ``tokens`` (B, S). Works
    on vocabulary-sharded logits (a DTensor) under ``loss_parallel``."""

    def __call__(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return self.on_output(model(input_ids=tokens).logits, tokens)

    def pipeline_parts(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tokens, tokens

    def on_output(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
        )

    def sequence_parallel(self, sp, tokens: torch.Tensor) -> torch.Tensor:
        return sp.loss(tokens)

    def __repr__(self) -> str:
        return "causal_lm_loss"


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
