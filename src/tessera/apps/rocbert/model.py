"""transformers' RoCBert classes sized from a feature set: the word, shape and pronunciation
vocabularies come from the files ``features`` wrote, the shape embedding starts from the
glyph vectors, and the fine-tuned classifier starts from the pretrained encoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.apps.rocbert.features import Features, init_shape_embedding


@dataclass(frozen=True, kw_only=True)
class RocbertSize:
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    intermediate: int = 128
    max_len: int = 64  # tokens, [CLS] and [SEP] included
    pronunciation_dim: int = 32
    use_pronunciation: bool = True  # ablations switch a view off (the plain BERT: both)
    use_shape: bool = True
    # the glyph vectors stay as drawn: look-alikes keep near-equal shape inputs, instead of the
    # shape rows training into a second, free per-character embedding (see docs/rocbert.md)
    freeze_shape: bool = True
    dropout: float = 0.1

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "intermediate", "max_len", "pronunciation_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"RocbertSize.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"RocbertSize.hidden={self.hidden} is not divisible by heads={self.heads}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"RocbertSize.dropout must lie in [0, 1), got {self.dropout}")


def rocbert_config(features: Features, size: RocbertSize, num_labels: int = 2):
    from transformers import RoCBertConfig

    return RoCBertConfig(
        vocab_size=len(features.tokens),
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=size.intermediate,
        max_position_embeddings=size.max_len,
        hidden_dropout_prob=size.dropout,
        attention_probs_dropout_prob=size.dropout,
        pad_token_id=0,
        enable_pronunciation=size.use_pronunciation,
        enable_shape=size.use_shape,
        pronunciation_vocab_size=features.pronunciation_vocab_size,
        pronunciation_embed_dim=size.pronunciation_dim,
        shape_vocab_size=len(features.tokens),
        shape_embed_dim=features.glyphs.shape[1],
        concat_input=True,  # [word | shape | pronunciation] -> Linear -> hidden, as ROCBERT fuses them
        num_labels=num_labels,
    )


def pretraining_model(features: Features, size: RocbertSize, seed: int = 0):
    """A fresh ``RoCBertForPreTraining`` (MLM head + the contrastive term), glyph-initialised."""
    from transformers import RoCBertForPreTraining

    torch.manual_seed(seed)
    model = RoCBertForPreTraining(rocbert_config(features, size))
    init_shape_embedding(model, features)
    return _frozen_views(model, size)


def _frozen_views(model, size: RocbertSize):
    model.roc_bert.embeddings.shape_embed.weight.requires_grad_(not size.freeze_shape)
    return model


def classifier_from(state: dict[str, torch.Tensor], features: Features, size: RocbertSize, seed: int = 0):
    """A ``RoCBertForSequenceClassification`` whose encoder is the pretrained one in ``state``
    (a ``RoCBertForPreTraining`` state dict); only the classification head is new."""
    from transformers import RoCBertForSequenceClassification

    torch.manual_seed(seed)
    model = RoCBertForSequenceClassification(rocbert_config(features, size))
    encoder = {k: v for k, v in state.items() if k.startswith("roc_bert.")}
    missing, unexpected = model.load_state_dict(encoder, strict=False)
    assert not unexpected and all(k.startswith("classifier.") for k in missing), (missing, unexpected)
    return _frozen_views(model, size)
