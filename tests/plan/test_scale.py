"""The heterogeneous-memory formulas (PatrickStar / Gemini chunks, ZeRO-Offload, DDP) against
hand-computed bytes, the step model's transfer bytes, the host floor and the decode term of
the DiT simulator on hand cases, and the two counts taken from diffusers' real models (aten
ops per block, VAE decoder FLOPs) against the constants the presets carry."""

import dataclasses

import pytest
import torch

from tessera.diffusion.layout import ParallelConfig
from tessera.plan.check_scale import capacity_check, scale_checks
from tessera.plan.devices import DeviceProfile
from tessera.plan.hardware import Hardware
from tessera.plan.hetero import (
    Node,
    calibrate_efficiency,
    capacity_params,
    fits,
    placement,
    step_seconds,
    tflops_total,
)
from tessera.plan.inference import predict_generate
from tessera.plan.model_presets import PRESETS
from tessera.plan.model_spec import TransformerSpec, gpt2_spec
from tessera.plan.published import TABLES
from tessera.plan.published_scale import capacity_rows, throughput_series
from tessera.runtime.link import Link

# 2 layers of 64 wide, 4 heads, 16 positions, vocabulary 100:
# P = 2 (12 * 64^2 + 13 * 64) + 100 * 64 + 16 * 64 + 2 * 64 = 99,968 + 7,552 = 107,520
TINY = gpt2_spec("tiny", 2, 64, 4, tokens=16, positions=16, vocab=100)
P = 107_520
# Non-model bytes at batch 1, seq 16, fp16, checkpointing: 2 layers x 2 s b h = 4,096 of
# checkpoints + one layer's activations s b h (34 + 5 a s / h) = 1,024 x 39 = 39,936.
ACTS = 4_096 + 39_936


def test_chunk_placement_is_14_bytes_a_parameter_over_gpu_and_cpu():
    """PatrickStar: fp16 param chunk (gradients reuse it) 2 + fp32 param, m, v 12 = 14 bytes
    a parameter, anywhere; the GPU holds what activations and 2 chunks in flight leave."""
    assert TINY.total_params == P
    node = Node(gpus=1, gpu_bytes=ACTS + 2 * 1000 + 500_000, cpu_bytes=14 * P - 500_000, chunk_bytes=1000)
    got = placement(TINY, "chunk", 1, 16, node)
    assert got == {"gpu": 500_000, "cpu": 14 * P - 500_000, "over": 0.0}
    assert fits(TINY, "chunk", 1, 16, node)
    short = dataclasses.replace(node, cpu_bytes=14 * P - 500_001)
    assert placement(TINY, "chunk", 1, 16, short)["over"] == 1.0 and not fits(TINY, "chunk", 1, 16, short)
    # approx's default 1e-6 relative: bytes / 14 in float64, only rounding apart
    assert capacity_params(TINY, "chunk", 1, 16, node) == pytest.approx(P)
    two = dataclasses.replace(node, gpus=2)  # a second GPU: its room, and 2 more chunks in flight on each
    assert placement(TINY, "chunk", 1, 16, two)["gpu"] == 2 * (500_000 - 2 * 1000)


def test_patrickstar_budget_the_warm_up_iteration_bounds_the_model():
    """PatrickStar's memory tracer gives chunks gpu_ratio of the GPU and cpu_ratio of the CPU,
    but in the warm-up iteration only warmup_gpu_ratio of the GPU share: with half of each
    memory and a tenth of that in warm-up, a 2 MB GPU holds 100,000 chunk bytes while warming
    up (not the 953,968 its steady state leaves), so the CPU's half must hold the rest."""
    from tessera.plan.hetero import PATRICKSTAR_BUDGET, ChunkBudget

    budget = ChunkBudget(gpu_ratio=0.5, cpu_ratio=0.5, warmup_gpu_ratio=0.1)
    cpu = 2 * (14 * P - 100_000)
    node = Node(gpus=1, gpu_bytes=2_000_000, cpu_bytes=cpu, chunk_bytes=1000, budget=budget)
    got = placement(TINY, "chunk", 1, 16, node)
    assert got["gpu"] == 1_000_000 - (ACTS + 2000) and got["over"] == 0.0  # steady state: 953,968 on the GPU
    assert capacity_params(TINY, "chunk", 1, 16, node) == pytest.approx(P)  # float64 rounding only
    assert not fits(TINY, "chunk", 1, 16, dataclasses.replace(node, cpu_bytes=cpu - 2))
    assert (PATRICKSTAR_BUDGET.gpu_ratio, PATRICKSTAR_BUDGET.warmup_gpu_ratio) == (
        0.8,
        0.1,
    )  # v0.4.3's benchmark


def test_zero_offload_and_ddp_bytes():
    """ZeRO-Offload on ZeRO-3: fp16 param + grad (4 bytes) partitioned over the GPUs, fp32
    param, m, v + fp16 grad (14) and the activation checkpoints on the CPU; DDP: 22 bytes a
    parameter on every GPU (fp32 param, grad, Adam 16 + DDP buckets 4 + autocast cache 2)."""
    ckpt = 2 * 2 * 16 * 1 * 64  # layers x 2 s b h, fp16, per GPU
    node = Node(gpus=2, gpu_bytes=1e9, cpu_bytes=1e9)
    got = placement(TINY, "zero-offload", 1, 16, node)
    assert got == {"gpu": 4 * P, "cpu": 14 * P + 2 * ckpt, "over": 0.0}
    tight = Node(gpus=2, gpu_bytes=1e9, cpu_bytes=14 * P + 2 * ckpt - 10)
    assert placement(TINY, "zero-offload", 1, 16, tight)["over"] == 10
    ddp = placement(TINY, "pytorch-ddp", 1, 16, Node(gpus=2, gpu_bytes=ACTS + 22 * P, cpu_bytes=0))
    assert ddp == {"gpu": 2 * 22 * P, "cpu": 0.0, "over": 0.0}
    assert not fits(TINY, "pytorch-ddp", 1, 16, Node(gpus=2, gpu_bytes=ACTS + 22 * P - 1, cpu_bytes=0))
    with pytest.raises(ValueError, match="system must be one of"):
        placement(TINY, "fsdp", 1, 16, node)


def test_chunk_step_moves_the_bytes_that_do_not_fit():
    """GPU room for half the fp16 param chunks: half the params move in twice and their grads
    out (3 x 2 bytes), every param's optimizer state is on the CPU, so each grad goes out and
    each param comes back (2 x 2 bytes); CPU Adam 28 bytes an element; moves add to compute."""
    room = P  # bytes: half of the 2P of fp16 parameter chunks
    node = Node(gpus=1, gpu_bytes=ACTS + 2 * 1000 + room, cpu_bytes=1e12, gpu_flops=1e12, gpu_bandwidth=1e12,
                pcie_bandwidth=1e9, cpu_bandwidth=1e10, chunk_bytes=1000)  # fmt: skip
    parts = step_seconds(TINY, "chunk", 1, 16, node, efficiency=0.5)
    # the same float64 formulas in another order: approx's default 1e-6 relative is ample
    assert parts["compute"] == pytest.approx(8 * P * 16 / 0.5e12)
    assert parts["pcie"] == pytest.approx((3 * 2 * P / 2 + 2 * 2 * P) / 1e9)
    assert parts["cpu_adam"] == pytest.approx(28 * P / 1e10) and parts["gpu_adam"] == 0.0
    eff = calibrate_efficiency(TINY, "chunk", 1, 16, node, 0.01)
    # 80 geometric bisection steps over [1e-4, 4] leave float64 rounding only: 1e-6 is loose
    assert tflops_total(TINY, "chunk", 1, 16, node, eff) == pytest.approx(0.01, rel=1e-6)


def test_published_scale_rows_and_checks():
    rows = capacity_rows()
    assert len(rows) == 40 and all(r.source for r in rows)
    first = capacity_check(rows[0])  # pstar-1-gpu on the V100 node: 12B trained, 15B not
    assert first["system"] == "pstar-1-gpu" and first["verdict"] in {"within", "over", "under"}
    series = throughput_series()
    assert sum(len(s.points) for s in series) == 30 + 47
    checks = scale_checks()
    v100 = [r for r in checks["capacity_ranking"] if r["gpus"] == 1 and "V100" in r["group"]][0]
    assert v100["published_order"] == "pstar-1-gpu > deeps-1-gpu > torch-1-gpu"
    assert all(r["rel_error"] == 0 for r in checks["throughput"] if r["calibration"])


UNIT = DeviceProfile(
    name="u", fp32_flops=1.0, bf16_flops=1.0, memory_bandwidth=1.0, memory_bytes=2**40, source="t"
)


def test_host_floor_and_decode_in_the_dit_simulator():
    """A layer whose kernels take less than the host needs to issue its ops takes the host's
    time (ops x seconds per op); the decoder runs once at the end, on one rank."""
    spec = TransformerSpec(name="u", layers=3, hidden=8, heads=2, ffn=32, tokens=4)
    hw = Hardware(device=UNIT, link=Link(name="l", bandwidth=1e30, latency=0.0), precision="fp32", efficiency=1.0)
    flops = spec.layers * spec.layer_flops()
    serial = predict_generate(spec, ParallelConfig(), hw, steps=2, guidance=False)
    assert serial.seconds == pytest.approx(2 * flops)  # default 1e-6 rel: float64 sums, another order
    slow_host = dataclasses.replace(hw, host_op_seconds=1e6)  # each layer's ops take 10 x 1e6 s to issue
    floored = predict_generate(
        dataclasses.replace(spec, host_ops_per_layer=10.0),
        ParallelConfig(),
        slow_host,
        steps=2,
        guidance=False,
    )
    assert floored.seconds == pytest.approx(2 * spec.layers * 10 * 1e6)  # as above: float64 rounding
    decoded = predict_generate(
        dataclasses.replace(spec, decode_flops=123.0),
        ParallelConfig(ulysses=2),
        hw,
        steps=2,
        guidance=False,
    )
    plain = predict_generate(spec, ParallelConfig(ulysses=2), hw, steps=2, guidance=False)
    assert decoded.seconds == pytest.approx(plain.seconds + 123.0)  # as above: float64 rounding


def test_block_op_counts_and_decoder_flops_match_the_presets():
    """The presets' host op counts and Flux's decoder FLOPs, recounted on diffusers' own
    models (tiny widths: the count of ops does not depend on the width)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel, SanaTransformer2DModel

    from tessera.plan.host_ops import count_block_ops, decode_flops

    def flux(double: int, single: int):
        torch.manual_seed(0)
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=double, num_single_layers=single, attention_head_dim=8,
            num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
            axes_dims_rope=(2, 2, 4),
        ).eval()  # fmt: skip
        kw = dict(
            hidden_states=torch.randn(1, 16, 16), encoder_hidden_states=torch.randn(1, 8, 32),
            pooled_projections=torch.randn(1, 16), timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3),
            txt_ids=torch.zeros(8, 3), guidance=torch.tensor([3.5]),
        )  # fmt: skip
        return lambda: model(**kw)

    double = count_block_ops(lambda n: flux(n, 1))
    single = count_block_ops(lambda n: flux(1, n))
    assert (double, single) == (158, 83)
    # approx's default 1e-6 relative: the preset holds this same fraction, computed in float64
    assert PRESETS["flux-dev"].host_ops_per_layer == pytest.approx((19 * double + 38 * single) / 76)

    def sana(n: int):
        torch.manual_seed(0)
        model = SanaTransformer2DModel(
            patch_size=1, in_channels=4, out_channels=4, num_layers=n, num_attention_heads=2, attention_head_dim=4,
            num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
            sample_size=8,
        ).eval()  # fmt: skip
        kw = dict(
            hidden_states=torch.randn(1, 4, 8, 8), encoder_hidden_states=torch.randn(1, 6, 8),
            timestep=torch.tensor([10]),
        )  # fmt: skip
        return lambda: model(**kw)

    assert count_block_ops(sana) == PRESETS["sana-1600m-4k"].host_ops_per_layer == 99
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
        latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
    )  # fmt: skip
    # rel=1e-3: the preset stores 4 significant digits (10.47e12)
    assert decode_flops(vae, (1, 16, 128, 128)) == pytest.approx(PRESETS["flux-dev"].decode_flops, rel=1e-3)


def test_every_published_xdit_table_starts_serial():
    assert len(TABLES) == 9 and sum(len(t.rows) for t in TABLES) == 47
    assert all(t.rows[0][0].world_size == 1 for t in TABLES)
    assert [t.compiled for t in TABLES].count(True) == 1


def test_host_seconds_fit_recovers_the_value_a_table_was_made_with(monkeypatch):
    """A table whose 'published' seconds the simulator made with 10 us per op: the fit (a
    2.5 us grid) finds 10 us, and the FLOPs-only column beside it misses the floor."""
    from tessera.plan import check
    from tessera.plan.devices import device_named
    from tessera.plan.published import PublishedTable
    from tessera.runtime.link import link_named

    # 2048 tokens: a layer's kernels take ~1.4 ms on one H100 at 0.4 of peak, less than the
    # host's 80 x 10 us = 0.8 ms on 2 and 4 ranks, so the floor decides those rows
    spec = dataclasses.replace(
        PRESETS["flux-dev"].with_tokens(2048), layers=4, host_ops_per_layer=80.0, decode_flops=0.0
    )
    monkeypatch.setitem(PRESETS, "flux-4-layers", spec)
    hw = Hardware(
        device=device_named("h100"), link=link_named("nvlink4"), efficiency=0.4, host_op_seconds=1e-5
    )
    configs = [ParallelConfig(), ParallelConfig(ulysses=2), ParallelConfig(ulysses=4)]
    rows = tuple((c, predict_generate(spec, c, hw, steps=4, guidance=False).seconds) for c in configs)
    table = PublishedTable(
        name="made", model="flux-4-layers", device="h100", link="nvlink4", steps=4, guidance=False, rows=rows,
        source="test",
    )  # fmt: skip
    # the grid point 60e-6 * 4 / 24: 1e-5 up to float64 rounding (approx's default 1e-6 relative)
    assert check.fit_host_op_seconds(table) == pytest.approx(1e-5)
    result = check.check_published(table, 1e-5)
    # rows report seconds rounded to 0.1 ms, and these runs take ~10 ms: 1% is that rounding
    assert result["within_20pct"] == 2 and max(abs(r["rel_error"]) for r in result["rows"]) < 1e-2
    assert result["flops_only_within_20pct"] < 2  # without the floor, 4 ranks look 4x faster
