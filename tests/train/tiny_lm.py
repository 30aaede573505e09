"""Tiny HuggingFace language models built from configs (no download), shared by the tests."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 128, 12


def tiny_gpt2(width: int = 32) -> GPT2LMHeadModel:
    """2 layers, 4 heads, lm_head tied to the token embedding, no dropout; seeded."""
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=width,
        n_layer=2,
        n_head=4,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def tiny_llama(
    *, kv_heads: int = 2, tied: bool = False, layers: int = 2, vocab: int = VOCAB
) -> LlamaForCausalLM:
    """4 query heads over ``kv_heads`` key/value heads, 32 wide; seeded."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)
