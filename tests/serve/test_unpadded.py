"""Unpadded (packed) batching equals the one-request-at-a-time model for BERT, RoBERTa,
DistilBERT and ALBERT, embeddings (mean and CLS pooling) and sequence classification,
for every batch composition tried and every attention split; so does the padded
baseline. The HF model code is untouched: the same loaded model object serves all."""

import random
from collections import Counter

import pytest
import torch

from tessera.kernels import dense as dense_module
from tessera.kernels.dense import amx_ready
from tessera.serve.model import load_model, reference_outputs
from tessera.serve.runner import PaddedRunner
from tessera.serve.synthetic import FAMILIES
from tessera.serve.unpadded import ATTENTION_MODES, UnpaddedRunner

# fp32 throughout. The packed batch runs the same ops on the same values; only GEMM
# blocking (T packed rows vs one input's n rows) and SDPA's block split change the order
# of float sums, ~1e-7 relative per op over 2 layers of O(1) layer-normed activations
# (measured max |diff| 2e-6). 1e-5 is 5x that; a wrong position, mask or pooling row
# moves outputs by 1e-2 or more (the last test shows it).
ATOL = RTOL = 1e-5


def compositions(max_length: int):
    rng = random.Random(0)
    yield [7]  # one request
    yield [9, 9, 9]  # equal lengths: packed == padded
    yield [2, max_length]  # the shortest and the longest
    yield [max_length] + [3] * 7  # one long, many short
    for _ in range(3):
        yield [rng.randint(2, max_length) for _ in range(rng.randint(2, 12))]


def tokens_for(lengths, vocab=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    # [CLS] ... [SEP] around random word ids (ids 5.. are words), as the tokenizer makes them
    return [[2, *torch.randint(5, vocab, (n - 2,), generator=g).tolist(), 3] for n in lengths]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("task,pooling", [("embed", "mean"), ("embed", "cls"), ("classify", "mean")])
def test_packed_batches_equal_one_request_at_a_time(encoder_dirs, family, task, pooling, monkeypatch):
    # no tuning record (a measured one may have chosen an AVX kernel): "auto" takes AMX where it runs
    monkeypatch.setattr(dense_module, "saved_choice", lambda *a: None)
    monkeypatch.setattr(dense_module, "save_choice", lambda *a: None)
    served = load_model(encoder_dirs[family, task], task=task, pooling=pooling)
    runners = [UnpaddedRunner(served, attention=mode) for mode in ATTENTION_MODES] + [PaddedRunner(served)]
    # the dense layers on Tessera's kernels (residuals fused where the family allows): the same
    # fp32 tolerance, the kernel's sums run in another (fixed) order than MKL's; on AVX only,
    # and (last) on AMX's bf16x6 tiles where the CPU has them, which keep a float32 GEMM's error
    runners.append(UnpaddedRunner(served, kernels="tessera", amx="off"))
    runners.append(UnpaddedRunner(served, kernels="tessera"))
    assert "amx" not in runners[-2].describe()["dense_isas"]
    assert runners[-1].describe()["dense_isas"] == (["amx"] if amx_ready() is None else runners[-2].describe()["dense_isas"])
    worst = 0.0
    for seed, lengths in enumerate(compositions(served.max_length)):
        sequences = tokens_for(lengths, seed=seed)
        expected = reference_outputs(served, sequences)
        assert expected.shape == (len(lengths), served.output_dim)
        for runner in runners:
            got = runner(sequences)
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL, msg=f"{runner.name} {lengths}")
            worst = max(worst, (got - expected).abs().max().item())
    print(f"{family} {task}/{pooling}: max |packed - one by one| = {worst:.2e}")
    on_kernels = runners[-1].describe()
    # every Linear of the model ran on the kernels (none fell back to torch's) ...
    linears = sum(isinstance(m, torch.nn.Linear) for m in served.model.modules())
    assert on_kernels["dense_calls"] >= linears and on_kernels["kernels"] == "tessera"
    # ... with the residual fused in BERT's and RoBERTa's two output blocks per layer
    assert on_kernels["fused_residuals"] == (
        2 * served.config.num_hidden_layers if family in ("bert", "roberta") else 0
    )
    assert on_kernels["gelus_fused"] == (
        served.config.num_hidden_layers if family in ("bert", "roberta") else 0
    )
    assert not any("forward" in m.__dict__ for m in served.model.modules())  # the model is left as it was
    # layers of one width share their output buffers (fewer than there are layers of that
    # width: each call takes one no tensor holds), yet an output still held is never written over
    pool, widths = runners[-1].dense.pool, Counter(m.out_features for m in served.model.modules()
                                                   if isinstance(m, torch.nn.Linear))
    wide = max(widths, key=widths.get)
    assert widths[wide] > 3 and len(pool[wide]) < widths[wide], (len(pool[wide]), widths)
    held = runners[-1](tokens_for([5, 9], seed=1))
    kept = held.clone()
    runners[-1](tokens_for([30, 2, 7], seed=2))
    assert torch.equal(held, kept)
    assert served.config._attn_implementation == "sdpa"  # the model's own choice is back


@pytest.mark.parametrize("family", ["bert", "albert"])
@pytest.mark.parametrize("task", ["embed", "classify"])
def test_the_encoders_pooler_is_skipped_and_the_mean_is_segment_reduces(encoder_dirs, family, task):
    """The encoder's own pooler (token 0 of the packed row: the first input's alone) is not run
    while a packed batch runs; only a classification head pools, once per batch, each input's
    first token. Mean pooling gives segment_reduce's bits."""
    served = load_model(encoder_dirs[family, task], task=task, pooling="mean")
    outputs = []
    hook = served.encoder.pooler.register_forward_hook(lambda m, args, out: outputs.append(out))
    try:
        runner = UnpaddedRunner(served)
        sequences = tokens_for([6, 11, 4])
        got = runner(sequences)
    finally:
        hook.remove()
    real = [o for o in outputs if o is not None]
    assert len(outputs) == (2 if task == "classify" else 1)  # the skipped call and the head's
    assert len(real) == (1 if task == "classify" else 0) and (not real or real[0].shape[0] == 3)
    torch.testing.assert_close(got, reference_outputs(served, sequences), atol=ATOL, rtol=RTOL)
    assert "forward" not in served.encoder.pooler.__dict__
    if task == "embed":
        packed = runner.prepare(sequences)
        with torch.inference_mode():
            hidden = runner.hidden_states(packed)
        assert torch.equal(runner._compute(packed), torch.segment_reduce(hidden, "mean", lengths=packed.lengths, axis=0))


def test_positions_matter_so_the_check_can_fail(encoder_dirs):
    """Packed without per-input positions (positions running on across inputs) is wrong by
    far more than the tolerance: the parity test above would catch it."""
    served = load_model(encoder_dirs["bert", "embed"])
    runner = UnpaddedRunner(served)
    sequences = tokens_for([20, 30])
    runner.position_offset = 0
    expected = reference_outputs(served, sequences)
    good = runner(sequences)
    lengths = torch.tensor([20, 30])
    ids = torch.tensor([t for s in sequences for t in s])[None]
    from tessera.serve.unpadded import Segments, packed_attention_on

    seg = Segments.build([20, 30], "per_request")
    with packed_attention_on(served.model), torch.inference_mode():
        hidden = served.encoder(input_ids=ids, tessera_segments=seg).last_hidden_state[0]
    wrong = torch.segment_reduce(hidden, "mean", lengths=lengths, axis=0)
    assert (good - expected).abs().max() < ATOL
    assert (wrong[1] - expected[1]).abs().max() > 100 * ATOL


def _served(model, family="bert"):
    from tessera.serve.families import FAMILIES as SERVED_FAMILIES
    from tessera.serve.model import ServedModel

    return ServedModel(
        model=model, tokenizer=None, task="embed", pooling="mean", max_length=64,
        family=SERVED_FAMILIES[family], name="tiny",
    )  # fmt: skip


def test_causal_and_training_models_are_refused_when_the_runner_is_built(encoder_dirs):
    """The unpadded runner attends bidirectionally and without dropout: a decoder-configured
    encoder, or a model left in training mode, is refused by name before any request."""
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    tiny = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64}
    decoders = [
        (BertModel(BertConfig(is_decoder=True, **tiny)).eval(), "bert", "BertModel"),
        (RobertaModel(RobertaConfig(is_decoder=True, **tiny)).eval(), "roberta", "RobertaModel"),
    ]
    for model, family, name in decoders:
        with pytest.raises(
            ValueError, match=f"^{name} has config.is_decoder=True \\(causal self-attention\\)"
        ):
            UnpaddedRunner(_served(model, family))
        PaddedRunner(_served(model, family))  # the HF model as it is: its own causal mask
    served = load_model(encoder_dirs["bert", "embed"])
    served.model.train()
    with pytest.raises(ValueError, match=r"^BertModel is in training mode \(dropout"):
        UnpaddedRunner(served)


def test_features_reaching_the_packed_attention_are_refused_at_the_layer(encoder_dirs):
    """What a layer could hand the attention function that the splits do not compute. The
    runner's build checks keep the served families from it; a layer that gets past them
    anyway is named."""
    from tessera.serve.unpadded import Segments, packed_attention

    served = load_model(encoder_dirs["bert", "embed"])
    layer = served.encoder.encoder.layer[0].attention.self
    q = k = v = torch.randn(1, 4, 10, 8)
    seg = Segments.build([4, 6], "per_request")
    cases = {
        "an attention mask": {"attention_mask": torch.zeros(1, 1, 10, 10)},
        "attention dropout 0.1": {"dropout": 0.1},
        "a sliding window": {"sliding_window": 4},
        "logit soft-capping": {"softcap": 30.0},
        "attention sinks": {"s_aux": torch.zeros(4)},
    }
    for feature, extra in cases.items():
        kwargs = {"attention_mask": None} | extra
        with pytest.raises(ValueError, match=f"^BertSelfAttention \\(layer 0\\) brings {feature}, which"):
            packed_attention(layer, q, k, v, scaling=0.35, tessera_segments=seg, **kwargs)
    layer.is_causal = True
    try:
        with pytest.raises(ValueError, match="brings causal attention"):
            packed_attention(layer, q, k, v, None, tessera_segments=seg)
    finally:
        layer.is_causal = False


def test_a_mask_reaching_a_whole_layer_runs_its_modules_and_is_refused(tmp_path):
    """A whole layer (BERT's, on Tessera's kernels) hands anything beyond what it computes to
    the layer's own modules: a mask reaching it is refused there by name, never ignored."""
    from tessera.serve.synthetic import EncoderSpec, build_encoder
    from tessera.serve.unpadded import packed_attention_on

    spec = EncoderSpec(layers=1, hidden=64, heads=4, vocab_size=200, max_length=64)
    served = load_model(build_encoder(tmp_path / "bert", spec))
    runner = UnpaddedRunner(served, kernels="tessera")
    assert runner.describe()["whole_layers"] == 1
    packed = runner.prepare(tokens_for([4, 6]))
    layer = served.encoder.encoder.layer[0]
    hidden = torch.randn(1, 10, 64)
    with runner.dense.on(), packed_attention_on(served.model):
        whole = layer(hidden, tessera_segments=packed.segments)  # no mask: the whole layer
        with pytest.raises(ValueError, match="brings an attention mask"):
            layer(hidden, torch.zeros(1, 1, 10, 10), tessera_segments=packed.segments)
    # the same values as the layer's own modules on torch's kernels, attention per input
    expected = torch.cat([layer(hidden[:, a:b])[0] for a, b in ((0, 4), (4, 10))])
    torch.testing.assert_close(whole[0], expected, atol=ATOL, rtol=RTOL)


def test_the_layers_softmax_scale_is_honoured_by_every_split(encoder_dirs, monkeypatch):
    """Every split passes the layer's own ``scaling`` to attention. With a scale that is not
    1/sqrt(head_dim) (set on each layer, as models with a query pre-scalar have), packed
    batches still equal the one-by-one model; a split that drops the scale does not."""
    from tessera.serve import unpadded

    served = load_model(encoder_dirs["bert", "embed"])
    for block in served.encoder.encoder.layer:
        # head_dim 8: the default is 0.354. The random encoder's scores are small (weights
        # ~0.02), so a large scale is what makes them matter: dropping it then moves outputs
        # by ~1e-2 (measured), 1000x the parity tolerance.
        block.attention.self.scaling = 20.0
    sequences = tokens_for([9, 30, 2, 17], seed=3)
    expected = reference_outputs(served, sequences)
    runners = [UnpaddedRunner(served, attention=mode) for mode in ATTENTION_MODES]
    runners.append(UnpaddedRunner(served, attention="padded", memory_plan=True))
    for runner in runners:
        # The same tolerance as the parity test above, for the same reason (fp32 reordering).
        torch.testing.assert_close(runner(sequences), expected, atol=ATOL, rtol=RTOL, msg=runner.describe())
    keep = unpadded._per_request
    monkeypatch.setattr(
        unpadded, "_per_request", lambda q, k, v, offsets, scaling: keep(q, k, v, offsets, None)
    )
    dropped = UnpaddedRunner(served)(sequences)
    print(f"scale dropped: max |packed - one by one| = {(dropped - expected).abs().max():.2e}")
    assert (dropped - expected).abs().max() > 100 * ATOL  # 10x short of what was measured


def test_encoder_families_with_other_attention_are_refused_when_loaded(tmp_path):
    """Only families whose attention is plain bidirectional softmax over the input are served:
    ModernBERT (local sliding-window layers, rotary positions) and DeBERTa-v2 (relative
    position biases) are named when their config is read, before any weights load."""
    from transformers import DebertaV2Config, ModernBertConfig

    for config in (ModernBertConfig(), DebertaV2Config(relative_attention=True)):
        folder = tmp_path / config.model_type
        config.save_pretrained(folder)
        with pytest.raises(
            ValueError, match=f"^model type '{config.model_type}' is not served; supported encoder"
        ):
            load_model(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_tessera_attention_kernel_serves_like_one_request_at_a_time(tmp_path, family):
    """Heads of 16 floats (64 wide, 4 heads) take Tessera's packed attention kernel as well as
    its dense layers: one call per layer for the whole batch. Same fp32 tolerance (the
    kernel's softmax exp is its own, ~2e-7 relative)."""
    from tessera.serve.synthetic import EncoderSpec, build_encoder

    spec = EncoderSpec(
        family=family, layers=2, hidden=64, heads=4, vocab_size=200, max_length=64, num_labels=3
    )
    served = load_model(build_encoder(tmp_path / family, spec), task="classify")
    runner = UnpaddedRunner(served, kernels="tessera")
    assert runner.describe()["attention_kernel"] == "tessera"
    # BERT's and RoBERTa's layers run whole (Q, K and V from one GEMM); the others module by module
    layers = served.config.num_hidden_layers if family in ("bert", "roberta") else 0
    assert runner.describe()["whole_layers"] == layers
    for seed, lengths in enumerate(compositions(served.max_length)):
        sequences = tokens_for(lengths, seed=seed)
        torch.testing.assert_close(
            runner(sequences), reference_outputs(served, sequences), atol=ATOL, rtol=RTOL
        )
    # a whole layer makes four dense calls (Q/K/V fused, output, intermediate, output) where the
    # same layer module by module (no attention kernel: the padded split) makes six
    by_modules = UnpaddedRunner(served, kernels="tessera", attention="padded")
    assert by_modules.describe()["whole_layers"] == 0
    calls = []
    for r in (runner, by_modules):
        before = r.describe()["dense_calls"]
        r(tokens_for([9, 4]))
        calls.append(r.describe()["dense_calls"] - before)
    assert calls[1] - calls[0] == 2 * layers
