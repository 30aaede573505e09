"""Tiny causal language models of every transformers family the tensor parallel battery
covers: each ships its own plan (``config.base_model_tp_plan``), built from a config (no
download), 2 layers, 32 wide, vocabulary 128, no dropout, seeded.

FAMILIES is the one list: model type -> config fields beyond the shared ones, and what the
family brings to the battery.
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB, SEQ = 128, 12

SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=SEQ,
    pad_token_id=0,  # some families default to an id beyond this vocabulary
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="eager",
)

FAMILIES: dict[str, dict] = {
    "llama": dict(num_key_value_heads=2),  # grouped-query attention: 2 key/value heads for 4
    "mistral": dict(num_key_value_heads=2, sliding_window=SEQ // 2),  # sliding-window attention
    "qwen2": dict(num_key_value_heads=2),  # q/k/v projections with biases
    "qwen3": dict(
        num_key_value_heads=2, head_dim=8
    ),  # per-head q_norm/k_norm: replicated_with_grad_allreduce
    "gemma": dict(num_key_value_heads=2, head_dim=8),  # head tied to the (scaled) embedding
    "phi": dict(),  # biases everywhere (the head too), partial rotary, fc1/fc2 and dense
    "phi3": dict(
        num_key_value_heads=2
    ),  # fused q|k|v and gate|up: colwise_gather_output, rowwise_split_input
    "gpt_neox": dict(),  # fused per-head q|k|v, parallel residual, its own embed_in entry
    "olmo2": dict(num_key_value_heads=2),  # q/k/v gathered whole, full-width q_norm/k_norm
    "starcoder2": dict(num_key_value_heads=2),  # LayerNorm, biased c_fc/c_proj MLP
    "granite": dict(num_key_value_heads=2),  # embedding, residual, attention and logit multipliers
}


def tiny_family(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SHARED, **FAMILIES[model_type])
    return AutoModelForCausalLM.from_config(config)
