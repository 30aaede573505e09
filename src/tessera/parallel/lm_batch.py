"""A causal-LM batch as the training plans take it: a (batch, tokens) tensor of ids, or a
dict with ``input_ids`` and ``attention_mask`` (1 = token, 0 = padding, left or right), and
its next-token labels. Light on purpose (no transformers import): losses use it too."""

from __future__ import annotations

import torch


def next_token_labels(ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) labels of a causal-LM batch: position i's next token, -100 past the end and
    wherever position i or i+1 is padding (a padding position's output is not a prediction)."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    if attention_mask is not None:
        real = attention_mask.bool()
        both = torch.cat([real[:, :-1] & real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
        labels = labels.masked_fill(~both, -100)
    return labels


def token_batch(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input ids, attention mask or None) of a causal-LM batch: a (B, T) tensor of ids, or a
    mapping with "input_ids" and optionally "attention_mask" (1 = token, 0 = padding)."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, dict) and "input_ids" in batch:
        unknown = set(batch) - {"input_ids", "attention_mask"}
        if unknown:
            raise ValueError(
                f"a causal-LM batch holds input_ids and attention_mask; got also {sorted(unknown)}"
            )
        mask = batch.get("attention_mask")
        if mask is not None and mask.shape != batch["input_ids"].shape:
            raise ValueError(
                f"attention_mask of shape {tuple(mask.shape)} does not match input_ids {tuple(batch['input_ids'].shape)}"
            )
        return batch["input_ids"], mask
    raise ValueError(
        f"a causal-LM batch is a (batch, tokens) tensor of ids or a dict with input_ids (and attention_mask); "
        f"got {type(batch).__name__}"
    )
