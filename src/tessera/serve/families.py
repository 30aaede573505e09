"""What the unpadded runner must know about each encoder family, kept as data beside the
HF model classes it describes: where positions start, and how the sequence-classification
head turns first-token states into logits (mirroring each family's own forward, so the
head runs on the first tokens of a packed batch instead of on ``hidden[:, 0]``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Head = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _bert_head(model: nn.Module, first: torch.Tensor) -> torch.Tensor:
    # BertForSequenceClassification: pooler (dense + tanh of token 0), dropout, classifier
    return model.classifier(model.dropout(model.bert.pooler(first[:, None])))


def _albert_head(model: nn.Module, first: torch.Tensor) -> torch.Tensor:
    pooled = model.albert.pooler_activation(model.albert.pooler(first))
    return model.classifier(model.dropout(pooled))


def _distilbert_head(model: nn.Module, first: torch.Tensor) -> torch.Tensor:
    pooled = torch.relu(model.pre_classifier(first))
    return model.classifier(model.dropout(pooled))


def _roberta_head(model: nn.Module, first: torch.Tensor) -> torch.Tensor:
    return model.classifier(first[:, None])  # RobertaClassificationHead reads features[:, 0]


@dataclass(frozen=True)
class Family:
    model_type: str
    head: Head
    roberta_positions: bool = False  # positions count from padding_idx + 1

    def position_offset(self, config) -> int:
        return config.pad_token_id + 1 if self.roberta_positions else 0


FAMILIES = {
    f.model_type: f
    for f in (
        Family("bert", _bert_head),
        Family("albert", _albert_head),
        Family("distilbert", _distilbert_head),
        Family("roberta", _roberta_head, roberta_positions=True),
        Family("xlm-roberta", _roberta_head, roberta_positions=True),
        Family("camembert", _roberta_head, roberta_positions=True),
    )
}


def family_of(config) -> Family:
    if config.model_type not in FAMILIES:
        raise ValueError(
            f"model type {config.model_type!r} is not served; supported encoder families: {', '.join(FAMILIES)}"
        )
    return FAMILIES[config.model_type]
