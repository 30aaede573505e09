"""Encoders built from configs with random weights and a word-level tokenizer made in
code, saved with ``save_pretrained`` like a user's download: what the tests and
`tessera bench serve` serve (nothing is downloaded). ``words(n)`` is a text that this
tokenizer turns into exactly ``n`` tokens, special tokens included."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
FAMILIES = ("bert", "roberta", "distilbert", "albert")


def vocabulary(size: int) -> list[str]:
    return SPECIALS + [f"w{i}" for i in range(size - len(SPECIALS))]


def words(n: int, *, seed: int = 0, vocab_size: int = 1000) -> str:
    """A text of exactly ``n`` tokens ([CLS] + n - 2 words + [SEP]); n >= 2."""
    if n < 2:
        raise ValueError(f"a text has at least 2 tokens ([CLS] and [SEP]), asked for {n}")
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, vocab_size - len(SPECIALS), (n - 2,), generator=g)
    return " ".join(f"w{i}" for i in picks.tolist())


def word_tokenizer(vocab_size: int, max_length: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=max_length,
    )


@dataclass(frozen=True, kw_only=True)
class EncoderSpec:
    family: str = "bert"
    layers: int = 2
    hidden: int = 32
    heads: int = 4
    intermediate: int | None = None  # default 4 x hidden
    vocab_size: int = 1000
    max_length: int = 512
    num_labels: int = 0  # > 0: a sequence classifier
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")


MINILM = EncoderSpec(layers=6, hidden=384, heads=12, intermediate=1536, vocab_size=30522)
BERT_BASE = EncoderSpec(layers=12, hidden=768, heads=12, intermediate=3072, vocab_size=30522)


def _config(spec: EncoderSpec):
    import transformers as tf

    inner = spec.intermediate or 4 * spec.hidden
    common = {"vocab_size": spec.vocab_size, "pad_token_id": 0}
    if spec.num_labels:
        common |= {"num_labels": spec.num_labels}
    if spec.family == "distilbert":
        return tf.DistilBertConfig(
            n_layers=spec.layers, dim=spec.hidden, n_heads=spec.heads, hidden_dim=inner,
            max_position_embeddings=spec.max_length, **common,
        )  # fmt: skip
    shared = {
        "num_hidden_layers": spec.layers,
        "hidden_size": spec.hidden,
        "num_attention_heads": spec.heads,
        "intermediate_size": inner,
    }
    if spec.family == "albert":
        return tf.AlbertConfig(embedding_size=max(16, spec.hidden // 2), max_position_embeddings=spec.max_length,
                               **shared, **common)  # fmt: skip
    if spec.family == "roberta":  # positions start after padding_idx (0), so two more slots
        return tf.RobertaConfig(max_position_embeddings=spec.max_length + 1, bos_token_id=2, eos_token_id=3,
                                **shared, **common)  # fmt: skip
    return tf.BertConfig(max_position_embeddings=spec.max_length, **shared, **common)


def build_encoder(directory: str | Path, spec: EncoderSpec = EncoderSpec()) -> Path:
    """Write a random-weight encoder of ``spec`` and its tokenizer to ``directory``."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(spec.seed)
    config = _config(spec)
    cls = AutoModelForSequenceClassification if spec.num_labels else AutoModel
    model = cls.from_config(config).eval()
    directory = Path(directory)
    model.save_pretrained(directory)
    word_tokenizer(spec.vocab_size, spec.max_length).save_pretrained(directory)
    _portable_tokenizer_class(directory / "tokenizer_config.json")
    return directory


def _portable_tokenizer_class(path: Path) -> None:
    """transformers 5 names the class of a tokenizer made from a `tokenizers` object
    ``TokenizersBackend``, which transformers 4 (what infinity-emb runs) cannot load;
    ``PreTrainedTokenizerFast`` is the same class to both, read from tokenizer.json."""
    import json

    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    path.write_text(json.dumps(config, indent=2) + "\n")
