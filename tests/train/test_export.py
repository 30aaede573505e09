"""The HuggingFace export carries its tokenizer: gpt2-text's byte tokenizer round-trips any
text through AutoTokenizer; an export without a known tokenizer says so in its folder."""

from transformers import AutoTokenizer, GPT2LMHeadModel

from tessera.train.export import NO_TOKENIZER, save_hf
from tessera.train.gpt2_text import byte_tokenizer, gpt2_lm

TEXT = "Grüße aus Köln: naïve café, 日本語, emoji 🙂, tabs\tand  spaces . , ok\n"


def _tiny():
    return gpt2_lm(vocab=256, n_embd=16, n_layer=1, n_head=2, seq=32)


def test_the_byte_tokenizer_is_the_recipes_bytes_and_round_trips(tmp_path):
    save_hf(_tiny(), None, tmp_path / "hf", is_writer=True, tokenizer=byte_tokenizer(32))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == list(TEXT.encode("utf-8"))  # the ids the recipe trains on: the UTF-8 bytes
    assert tokenizer.decode(ids) == TEXT
    assert len(tokenizer) == 256 == GPT2LMHeadModel.from_pretrained(tmp_path / "hf").config.vocab_size
    assert not (tmp_path / "hf" / "README.md").exists()


def test_an_export_without_a_tokenizer_says_so(tmp_path):
    save_hf(_tiny(), None, tmp_path / "hf", is_writer=True)
    assert (tmp_path / "hf" / "README.md").read_text() == NO_TOKENIZER
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
