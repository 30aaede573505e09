"""Unpadded (packed) batching equals the one-request-at-a-time model for BERT, RoBERTa,
DistilBERT and ALBERT, embeddings (mean and CLS pooling) and sequence classification,
for every batch composition tried and every attention split; so does the padded
baseline. The HF model code is untouched: the same loaded model object serves all."""

import random

import pytest
import torch

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
def test_packed_batches_equal_one_request_at_a_time(encoder_dirs, family, task, pooling):
    served = load_model(encoder_dirs[family, task], task=task, pooling=pooling)
    runners = [UnpaddedRunner(served, attention=mode) for mode in ATTENTION_MODES] + [PaddedRunner(served)]
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
    assert served.config._attn_implementation == "sdpa"  # the model's own choice is back


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
