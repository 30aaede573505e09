"""Tiny causal LMs of the transformers families whose attention asks for more than a causal
softmax, one list for the attention battery (test_attention_battery.py): model type ->
config fields beyond the shared ones, and the feature the family brings. Built from configs
(no download), 2 layers, 32 wide, vocabulary 96, no dropout, eager attention (the reference
implementation of every feature: sdpa refuses soft-capping and sinks), seeded.

Sequences are 16 tokens and every window is 4, so a window cuts every row; the padded batch
has left-padded, right-padded and whole rows (``padded_batches``).
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB, SEQ, WINDOW = 96, 16, 4

SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="eager",
)

FAMILIES: dict[str, dict] = {
    "llama": dict(),  # padding masks (left and right), grouped-query attention
    "mistral": dict(sliding_window=WINDOW),  # a sliding window on every layer
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # full, then sliding
    "gemma2": dict(  # alternating sliding/full, attention and final logit soft-caps, scale 1/sqrt(24)
        head_dim=8,
        sliding_window=WINDOW,
        attn_logit_softcapping=0.2,  # small enough to bend these tiny scores
        final_logit_softcapping=0.5,
        query_pre_attn_scalar=24,
        initializer_range=0.2,  # scores large enough that the caps bend them (1e-3 of the loss)
    ),
    "gemma3_text": dict(  # sliding then full, each with its own rotary base
        head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    ),
    "gpt_oss": dict(  # attention sinks, alternating sliding/full (and a mixture of experts)
        head_dim=8,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}

# Families whose attention Tessera's sequence-parallel and pipeline paths refuse by name.
REFUSED = {
    "bloom": dict(n_layer=2, hidden_size=32, n_head=4, vocab_size=VOCAB),  # ALiBi, own attention code
    "falcon": dict(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, alibi=True
    ),  # ALiBi
    "granite": dict(SHARED, embedding_multiplier=2.0),  # a multiplier in the base forward (pipeline)
}


def tiny_family(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if model_type in REFUSED:
        config = AutoConfig.for_model(model_type, **REFUSED[model_type])
    else:
        config = AutoConfig.for_model(model_type, **SHARED, **FAMILIES[model_type])
    return AutoModelForCausalLM.from_config(config)


def padded_batches(steps: int = 2, batch: int = 4) -> list[dict]:
    """Global batches of ``batch`` rows: left-padded by 5 and by 1, right-padded by 3, whole
    (each micro-batch and replica holds a different number of tokens)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
        mask = torch.ones(batch, SEQ, dtype=torch.long)
        mask[0, :5] = 0
        mask[1, SEQ - 3 :] = 0
        mask[3 % batch, :1] = 0
        ids = ids.masked_fill(mask == 0, 0)  # the pad token where there is padding
        out.append({"input_ids": ids, "attention_mask": mask})
    return out
