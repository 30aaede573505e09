"""ZeRO with its collectives overlapped (``Plan.prefetch`` > 0: stage 3's all-gathers of the
next chunks issued while a module computes, stage 2/3's reduce-scatters left in flight
until the end of backward) trains bit for bit as the synchronous engine (``prefetch=0``):
the same collectives sum the same bytes in the same order, only the waits move. So the
tolerance is zero (torch.equal) on parameters and losses after a few AdamW steps, on 2
gloo ranks: ZeRO-2 and ZeRO-3, several chunks per rank, a tied embedding and an unused
parameter, gradient accumulation, clipping, activation checkpointing, bf16 autocast, and
ZeRO-3 offloaded to a host budget with a disk tier (its all-gathers overlap too).

Also shown: the overlapped runs did leave collectives in flight (counted), never more than
``prefetch`` at once; and the bad settings are refused before training.
"""

import pytest
import torch
from test_boost_parity import _batches, _full_params, _gpt2, _optimizer
from tiny_lm import tiny_llama

import tessera
from tessera.runtime import spawn
from tessera.train.losses import causal_lm_loss

BUILDERS = {"gpt2": _gpt2, "llama": lambda: tiny_llama(layers=3)}
RUNS = [  # (family, Plan settings beside dp=2): each trained with prefetch 0 and each of PREFETCH
    ("gpt2", dict(zero=3, chunk_mib=0.01, grad_accum=2, max_grad_norm=0.5)),
    ("llama", dict(zero=3, block_chunks=True, activation_checkpointing=True)),
    ("llama", dict(zero=3, chunk_mib=0.01, precision="bf16")),
    ("gpt2", dict(zero=2, chunk_mib=0.01, grad_accum=2, max_grad_norm=0.5)),
    ("llama", dict(zero=2, block_chunks=True, precision="bf16")),
    ("gpt2", dict(zero=3, chunk_mib=0.016, offload="auto", host_memory=120_000, max_grad_norm=0.5)),
]
PREFETCH = (1, 2)


def _train(family, settings, prefetch, folder):
    if settings.get("offload"):
        settings = dict(settings, offload_dir=f"{folder}/{family}-{prefetch}-{torch.distributed.get_rank()}")
    model = BUILDERS[family]()
    plan = tessera.Plan(dp=2, prefetch=prefetch, **settings)
    model, opt = tessera.boost(model, _optimizer(model), plan)
    losses = [opt.train_step(batch, causal_lm_loss)["loss"] for batch in _batches()]
    # autograd's view of the chunks: a gather must leave a buffer's version counter as it found
    # it (views saved in forward are checked against it in backward), also when gloo writes an
    # asynchronous result on its own thread after the call returned
    versions = [cg.chunk.buffer._version for cg in opt.engine.groups]
    inflight = opt.engine.inflight
    return losses, _full_params(model, opt), dict(inflight.issued), dict(inflight.peak), versions


def _worker(folder):
    out = []
    for family, settings in RUNS:
        ref_losses, ref_params, issued, _, ref_versions = _train(family, settings, 0, folder)
        assert issued == {"all_gather": 0, "reduce_scatter": 0}, issued  # prefetch=0: all synchronous
        for n in PREFETCH:
            losses, params, issued, peak, versions = _train(family, settings, n, folder)
            assert versions == ref_versions, (family, settings, n, versions, ref_versions)
            out.append((family, settings, n, losses == ref_losses, ref_losses, losses, issued, peak))
            for name, ref in ref_params.items():
                assert torch.equal(params[name], ref), (
                    family,
                    settings,
                    n,
                    name,
                    (params[name] - ref).abs().max(),
                )
    return out


def test_overlapped_zero_is_bit_exact_with_the_synchronous_engine(tmp_path):
    for family, settings, n, same, ref_losses, losses, issued, peak in spawn(_worker, 2, str(tmp_path))[0]:
        label = (family, settings, n)
        assert same, (label, losses, ref_losses)  # exact: the same sums in the same order
        if settings.get("offload"):  # offloaded gradient shards are reduced synchronously
            assert issued["reduce_scatter"] == 0, (label, issued)
        else:
            assert 0 < peak["reduce_scatter"] <= n, (label, peak)  # left in flight, within the bound
        if settings["zero"] == 3:
            assert issued["all_gather"] > 0 and 0 < peak["all_gather"] <= n, (label, issued, peak)
        else:
            assert issued["all_gather"] == 0, (label, issued)  # ZeRO-2 gathers only after the step


def test_prefetch_beyond_the_offload_budget_is_refused_before_training(tmp_path):
    """0.016 MiB chunks of the tiny GPT-2 on one rank: a whole chunk and its shard are ~16.8 kB
    each, the largest use (master, gradient, two moments) ~67 kB; 80 kB holds that, not three
    whole chunks at once with the two being gathered from their shards (~84 kB, prefetch=2)."""
    model = _gpt2()
    plan = tessera.Plan(
        zero=3, chunk_mib=0.016, offload="auto", host_memory=80_000, offload_dir=str(tmp_path), prefetch=2
    )
    with pytest.raises(
        ValueError,
        match=r"^Plan.prefetch=2 holds up to 3 whole chunks at once, 2 of them still being gathered .* \(\d+ bytes\)",
    ):
        tessera.boost(model, _optimizer(model), plan)
    assert all(p.numel() > 0 for p in model.parameters())  # refused before any chunk was freed


def test_bad_prefetch_is_refused_before_training():
    with pytest.raises(ValueError, match=r"^Plan.prefetch must be a whole number of chunks >= 0 .* got -1$"):
        tessera.Plan(dp=2, zero=3, prefetch=-1)
    with pytest.raises(ValueError, match="got True"):
        tessera.Plan(prefetch=True)
