"""Loading an encoder saved with ``save_pretrained`` (tokenizer files beside it), offline,
as the thing a server serves: the HF model as it is, its tokenizer, the task (embeddings
or sequence classification), the pooling and the longest input it takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tessera.serve.families import Family, family_of

TASKS = ("auto", "embed", "classify")
POOLINGS = ("mean", "cls")


@dataclass
class ServedModel:
    model: nn.Module  # AutoModel (embed) or AutoModelForSequenceClassification (classify)
    tokenizer: object
    task: str
    pooling: str
    max_length: int
    family: Family
    name: str
    id2label: dict[int, str] = field(default_factory=dict)

    @property
    def config(self):
        return self.model.config

    @property
    def encoder(self) -> nn.Module:
        return self.model.base_model

    @property
    def pad_token_id(self) -> int:
        pad = self.config.pad_token_id
        return 0 if pad is None else pad

    @property
    def output_dim(self) -> int:
        return len(self.id2label) if self.task == "classify" else self.config.hidden_size


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def load_model(path: str | Path, *, task: str = "auto", pooling: str = "mean") -> ServedModel:
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    from tessera.compat import check_versions

    check_versions("transformers")  # the unpadded runner mirrors its attention interface and encoder layouts
    check_choice("task", task, TASKS)
    check_choice("pooling", pooling, POOLINGS)
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds no config.json: give a folder written by save_pretrained")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    family = family_of(config)
    is_classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    if task == "auto":
        task = "classify" if is_classifier else "embed"
    if task == "classify" and not is_classifier:
        raise ValueError(
            f"{path} is not a sequence classifier (architectures {config.architectures}); serve it with task embed"
        )
    cls = AutoModelForSequenceClassification if task == "classify" else AutoModel
    model = cls.from_pretrained(path, local_files_only=True, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    positions = config.max_position_embeddings - family.position_offset(config)
    limit = getattr(tokenizer, "model_max_length", None) or positions
    labels = {int(k): v for k, v in (config.id2label or {}).items()} if task == "classify" else {}
    return ServedModel(
        model=model,
        tokenizer=tokenizer,
        task=task,
        pooling=pooling,
        max_length=int(min(positions, limit)),
        family=family,
        name=path.resolve().name,
        id2label=labels,
    )


@torch.inference_mode()
def reference_outputs(served: ServedModel, sequences: list[list[int]]) -> torch.Tensor:
    """The one-request-at-a-time model: each input alone through the HF model as it is
    (no padding, no mask), pooled as served. What every runner is checked against."""
    rows = []
    for tokens in sequences:
        out = served.model(input_ids=torch.tensor([tokens]))
        if served.task == "classify":
            rows.append(out.logits[0])
        else:
            hidden = out.last_hidden_state[0]
            rows.append(hidden.mean(0) if served.pooling == "mean" else hidden[0])
    return torch.stack(rows)
