"""Which tensor parallel plan a model gets (read from its config, never from its class name),
and the errors a plan gives before anything is sharded. Single process: every check here
fails before a device mesh is needed."""

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from tessera.models.dit import DiT, DiTConfig
from tessera.parallel.tp_plans import DIT, TPPlan, apply_tp, plan_for
from tessera.parallel.tp_styles import REFUSED, STYLES

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)


def _llama():
    return LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2, max_position_embeddings=12))


class OddlyNamedGPT2(GPT2LMHeadModel):  # "llama" in a class name must not matter
    pass


class LlamaLookalike(OddlyNamedGPT2):
    pass


class MyDecoder(LlamaForCausalLM):
    pass


def test_a_shipped_plan_comes_from_the_config():
    model = MyDecoder(_llama().config)
    plan = plan_for(model)
    assert plan.family == "llama" and plan.layers == model.tp_plan
    # transformers' resolution: the base plan under the "model." prefix, the head from the class
    assert plan.layers["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan.layers["model.embed_tokens"] == "embedding_rowwise"
    assert plan.layers["lm_head"] == "colwise_gather_output" and not plan.vocab_parallel_loss


def test_own_plans_by_model_type_keyed_to_the_base_model():
    gpt2 = plan_for(LlamaLookalike(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=128)))
    assert gpt2.family == "gpt2" and gpt2.layers["transformer.h.*.attn.c_attn"] == "colwise"
    assert gpt2.layers["lm_head"] == "vocab_logits" and gpt2.vocab_parallel_loss
    bert_config = BertConfig(**TINY)
    masked = plan_for(BertForMaskedLM(bert_config))
    assert masked.layers["bert.encoder.layer.*.attention.self.query"] == "colwise"
    assert masked.layers["cls.predictions.decoder"] == "vocab_logits"
    base = plan_for(BertModel(bert_config))  # the base model itself: no prefix, no head
    assert "encoder.layer.*.attention.self.query" in base.layers and not base.vocab_parallel_loss

    class Subclassed(DiT):
        pass

    assert plan_for(Subclassed(DiTConfig(hidden_size=32, depth=1))) is DIT


def test_no_plan_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no tensor parallel plan for Sequential; plans exist for"):
        plan_for(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_mixture_of_experts_styles_are_refused_by_name():
    config = AutoConfig.for_model(
        "mixtral", **TINY, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        ValueError,
        match=r"style 'packed_colwise' \(plan 'mixtral', pattern 'model.layers.\*.mlp.experts.gate_up_proj'\) "
        r"is not supported: it is for fused weights",
    ):
        apply_tp(model, plan_for(model), None, 2)


@pytest.mark.parametrize("style", sorted(REFUSED))
def test_every_refused_style_names_itself_and_the_entry(style):
    plan = TPPlan(family="llama", layers={"model.layers.*.mlp.up_proj": style})
    with pytest.raises(
        ValueError, match=rf"style '{style}' \(plan 'llama', pattern 'model.layers.\*.mlp.up_proj'\)"
    ):
        apply_tp(_llama(), plan, None, 2)


@pytest.mark.parametrize(
    "layers, message",
    [
        ({"model.embed_tokens": "fancy"}, r"unknown tensor parallel style 'fancy' \(plan 'llama', pattern"),
        (
            {"model.embed_tokens": "colwise"},
            r"'colwise' applies to Linear, but module 'model.embed_tokens' is a Embedding",
        ),
        ({"model.*.q_proj": "colwise"}, r"pattern 'model.\*.q_proj' matches no module"),  # '*' is one segment
        ({"model.embed_tokens.weight": "colwise"}, r"names parameters, not modules"),
        (
            {"model.layers.*.mlp.up_proj": "colwise", "model.layers.0.mlp.*_proj": "rowwise"},
            r"module 'model.layers.0.mlp.up_proj' matches pattern 'model.layers.\*.mlp.up_proj' \(colwise\) and",
        ),
        (
            {"model.layers.*.mlp.up_proj": "colwise_gather_output"},
            r"tp=3 does not divide the output features \(64\)",
        ),
        (
            {"model.layers.*.self_attn.q_proj": "colwise"},
            r"tp=3 does not divide num_attention_heads=4 of LlamaFor",
        ),
    ],
)
def test_plan_mistakes_are_named(layers, message):
    degree = 3 if "tp=3" in message else 2
    with pytest.raises(ValueError, match=message):
        apply_tp(_llama(), TPPlan(family="llama", layers=layers), None, degree)


def test_every_shipped_style_is_supported_or_refused():
    """A style name transformers registers that Tessera neither maps nor refuses would fail
    only as 'unknown'; this lists them all so a transformers upgrade shows up here."""
    import transformers.distributed.expert_parallel  # noqa: F401 (registers its styles too)
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    unmapped = set(ALL_PARALLEL_STYLES) - set(STYLES) - set(REFUSED)
    assert not unmapped, f"transformers styles neither supported nor refused: {sorted(unmapped)}"


def test_sequence_parallel_norms_refuse_other_layouts_by_name():
    """Megatron sequence parallelism re-lays the norms and block inputs of Llama-style decoders
    only; any other layout, a plan not starting at a vocabulary-parallel embedding, or a style
    it cannot turn sequence-parallel is named before anything is sharded."""
    from tessera.parallel.tp_sequence import sequence_parallel_styles

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=128))
    with pytest.raises(
        ValueError, match=r"needs decoder layers with input_layernorm, .* GPT2LMHeadModel has another"
    ):
        sequence_parallel_styles(gpt2, {})
    llama = _llama()
    with pytest.raises(ValueError, match=r"starts the sequence split at a vocabulary-parallel embedding"):
        sequence_parallel_styles(llama, {"model.layers.0.mlp.down_proj": "rowwise"})
    with pytest.raises(
        ValueError, match=r"cannot take style 'rowwise_rep' at 'model.layers.0.mlp.down_proj'"
    ):
        sequence_parallel_styles(llama, {"model.layers.0.mlp.down_proj": "rowwise_rep"})
