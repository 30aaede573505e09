"""Runners: a batch of token-id lists in, one output row per input out (the pooled
embedding before normalisation, or the classifier's logits).

`PaddedRunner` is how text-embeddings-inference's CPU path and infinity-emb run a batch:
pad every input to the longest, mask the padding, the HF model as it is. The unpadded
runner (`unpadded.py`) is Tessera's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tessera.serve.model import ServedModel


class Runner(ABC):
    padded: bool = True
    name: str = "runner"

    def __init__(self, served: ServedModel):
        self.served = served

    @abstractmethod
    def forward(self, sequences: list[list[int]]) -> torch.Tensor:
        """(len(sequences), output_dim) float32."""

    def __call__(self, sequences: list[list[int]]) -> torch.Tensor:
        with torch.inference_mode():
            return self.forward(sequences).float()


class PaddedRunner(Runner):
    name = "padded"

    def forward(self, sequences: list[list[int]]) -> torch.Tensor:
        served = self.served
        longest = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), longest), served.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, tokens in enumerate(sequences):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        out = served.model(input_ids=ids, attention_mask=mask)
        if served.task == "classify":
            return out.logits
        hidden = out.last_hidden_state
        if served.pooling == "cls":
            return hidden[:, 0]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1)
