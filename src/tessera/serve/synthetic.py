"""Encoders built from configs with random weights and a word-level tokenizer made in
code, saved with ``save_pretrained`` like a user's download: what the tests and
`tessera bench serve` serve (nothing is downloaded). ``words(n)`` is a text that this
tokenizer turns into exactly ``n`` tokens, special tokens included.

``save_example_encoder`` (`tessera serve --make-example-model DIR`) writes one with an English
WordPiece tokenizer instead, for a user to try the server on real text."""

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
    return _save(directory, spec, word_tokenizer(spec.vocab_size, spec.max_length))


def _save(directory: str | Path, spec: EncoderSpec, tokenizer) -> Path:
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(spec.seed)
    config = _config(spec)
    cls = AutoModelForSequenceClassification if spec.num_labels else AutoModel
    model = cls.from_config(config).eval()
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    _portable_tokenizer_class(directory / "tokenizer_config.json")
    return directory


def english_vocabulary(size: int = 6000) -> list[str]:
    """A WordPiece vocabulary of English: the special tokens, every lower-case printable ASCII
    character alone and letters and digits as word pieces (``##e``), so that any word spells
    out and none is [UNK], then
    the most frequent words of Python's own documentation (``pydoc_data``, shipped with
    CPython: nothing is downloaded), ties by spelling so the list is the same on every run."""
    import re
    import string
    from collections import Counter
    from pydoc_data.topics import topics

    chars = [c for c in string.printable if not (c.isspace() or c.isupper())]  # text is lower-cased
    counts = Counter(re.findall(r"[a-z]+", " ".join(topics.values()).lower()))
    pieces = [*SPECIALS, *chars, *(f"##{c}" for c in chars if c.isalnum())]
    seen = set(pieces)
    ranked = [w for w, _ in sorted(counts.items(), key=lambda wc: (-wc[1], wc[0])) if w not in seen]
    return pieces + ranked[: max(0, size - len(pieces))]


def english_tokenizer(max_length: int = 512, size: int = 6000):
    """BERT's tokenization (lower-cased, accents stripped, split at spaces and punctuation,
    WordPiece with [CLS] ... [SEP]) over ``english_vocabulary``; as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(english_vocabulary(size))}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=max_length,
    )


def save_example_encoder(directory: str | Path, *, max_length: int = 512, seed: int = 0) -> Path:
    """A folder ``tessera serve --model`` serves, to try the server with: a small BERT encoder
    (2 layers, 128 wide; random weights, so its embeddings tell texts apart but carry no
    meaning) and an English WordPiece tokenizer (``english_tokenizer``) beside it, written as
    ``save_pretrained`` writes a downloaded model. ``directory`` must be new or empty."""
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ValueError(f"{directory} is not an empty folder; give a new one for the example encoder")
    tokenizer = english_tokenizer(max_length)
    spec = EncoderSpec(
        layers=2, hidden=128, heads=4, vocab_size=len(tokenizer), max_length=max_length, seed=seed
    )
    return _save(directory, spec, tokenizer)


def _portable_tokenizer_class(path: Path) -> None:
    """transformers 5 names the class of a tokenizer made from a `tokenizers` object
    ``TokenizersBackend``, which transformers 4 (what infinity-emb runs) cannot load;
    ``PreTrainedTokenizerFast`` is the same class to both, read from tokenizer.json."""
    import json

    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    path.write_text(json.dumps(config, indent=2) + "\n")
