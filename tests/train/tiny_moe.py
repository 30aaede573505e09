"""Tiny mixture-of-experts causal language models from configs (no download): 2 layers,
32 wide, 8 experts of which each token takes 2, vocabulary 128, no dropout, seeded. Each
family ships its expert parallel plan (``config.base_model_ep_plan``)."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB, SEQ, EXPERTS, TOP_K = 128, 12, 8, 2

SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    num_experts_per_tok=TOP_K,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="eager",
)

FAMILIES: dict[str, dict] = {
    "mixtral": dict(num_local_experts=EXPERTS),  # softmax top-2, weights renormalised
    # a shared expert beside the routed ones (dense parameters inside the MoE block);
    # top-k weights not renormalised
    "qwen2_moe": dict(
        num_experts=EXPERTS,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
    ),
    "qwen3_moe": dict(num_experts=EXPERTS, moe_intermediate_size=32, head_dim=8, norm_topk_prob=True),
}


def tiny_moe(family: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **(SHARED | FAMILIES.get(family, {}) | overrides))
    return AutoModelForCausalLM.from_config(config)
