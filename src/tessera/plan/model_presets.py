"""The planner's presets: the transformers and diffusion models `tessera plan` knows by
name, with the numbers each is built from (its config's sizes, its pipeline's eager ops per
block, its decoder's FLOPs) and what each estimate counts of the real pipeline."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tessera.plan.model_spec import TransformerSpec, _moe_spec_from_config, dit_spec, gpt2_spec

# Aten ops one eager forward dispatches per layer-equivalent, counted by
# tessera.plan.host_ops.count_block_ops on diffusers' own blocks (tests/plan checks them):
# Flux 158 per double block (two layer-equivalents) and 83 per single block, 19 + 38 of them;
# SANA 99 per block; HunyuanVideo 162 per double and 98 per single block, 20 + 40 of them.
FLUX_OPS = (19 * 158 + 38 * 83) / 76
SANA_OPS = 99.0
HUNYUAN_OPS = (20 * 162 + 40 * 98) / 80
# CogVideoX's block with rotary embeddings (the 5B's): 116 aten ops (tests/plan recounts it).
COGVIDEOX_OPS = 116.0
# decode_flops: diffusers' decoders run under torch.utils.flop_counter on the meta device
# (tessera.plan.host_ops.decode_flops): Flux's AutoencoderKL at 1024px 10.47 TFLOP, SANA's
# DC-AE f32c32 at 4096px 133.9 TFLOP, HunyuanVideo's 3D VAE at 129 x 720 x 1280 2473.5 TFLOP,
# AutoencoderKLCogVideoX (diffusers' default architecture) at 49 x 480 x 720 315.0 TFLOP.


# Mixture-of-experts language models, counted from their transformers configs' numbers by the
# same formula as a config.json (_moe_spec_from_config); the totals agree with the published
# ones (Mixtral 8x7B 46.7B, Qwen3-30B-A3B 30.5B).
MOE_CONFIGS = {
    "mixtral-8x7b": (
        dict(
            model_type="mixtral",
            num_hidden_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
        "mistralai/Mixtral-8x7B-v0.1 config (46.7B, 8 experts, top-2)",
    ),
    "qwen3-30b-a3b": (
        dict(
            model_type="qwen3_moe",
            num_hidden_layers=48,
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
            max_position_embeddings=4096,
        ),
        "Qwen/Qwen3-30B-A3B config (30.5B, 128 experts, top-8)",
    ),
}


def _moe_preset(name: str) -> TransformerSpec:
    cfg, source = MOE_CONFIGS[name]
    spec = _moe_spec_from_config(
        cfg,
        Path(name),
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg.get("num_local_experts") or cfg["num_experts"],
        None,
    )
    return dataclasses.replace(spec, name=name, source=source)


PRESETS: dict[str, TransformerSpec] = {
    s.name: s
    for s in (
        gpt2_spec("gpt2", 12, 768, 12),
        gpt2_spec("gpt2-medium", 24, 1024, 16),
        gpt2_spec("gpt2-large", 36, 1280, 20),
        gpt2_spec("gpt2-xl", 48, 1600, 25),
        # The DiT of `tessera bench dit` (BENCH_MODEL there) at 64x64 latents.
        dit_spec("bench-dit", latent=64, patch=2, layers=12, hidden=384, heads=6, source="tessera bench dit"),
        # PixArt-alpha XL/2 at 1024px: 128x128 latent, 2x2 patches, 28 layers, 1152 wide, 16 heads.
        dit_spec(
            "pixart-alpha",
            latent=128,
            patch=2,
            layers=28,
            hidden=1152,
            heads=16,
            cross_attention=True,
            adaln_single=True,
            params=611_000_000,
            source="PixArt-alpha paper (0.6B), transformer config of PixArt-XL-2-1024-MS",
        ),
        # FLUX.1-dev at 1024px: 19 double + 38 single blocks (a double block is two streams, so
        # counted as 2 layers: 76 layer-equivalents of 3072 wide), 4096 image + 512 text tokens.
        dit_spec(
            "flux-dev",
            latent=128,
            patch=2,
            layers=76,
            hidden=3072,
            heads=24,
            text_tokens=512,
            params=11_900_000_000,
            host_ops_per_layer=FLUX_OPS,
            decode_flops=10.47e12,
            source="black-forest-labs FLUX.1-dev transformer config (12B)",
        ),
        # SANA 1600M at 4096px: DC-AE (32x) latent 128x128, patch 1, 20 layers, 2240 wide,
        # linear attention, Mix-FFN 2.5x.
        dit_spec(
            "sana-1600m-4k",
            latent=128,
            patch=1,
            layers=20,
            hidden=2240,
            heads=70,
            mlp_ratio=2.5,
            params=1_600_000_000,
            linear_attention=True,
            text_tokens=300,
            host_ops_per_layer=SANA_OPS,
            decode_flops=133.9e12,
            source="SANA paper (1.6B), Sana_1600M_4Kpx config",
        ),
        # HunyuanVideo 13B at 1280x720, 129 frames: latent 33 x 90 x 160, 1x2x2 patches ->
        # 118,800 tokens (+256 text); 20 double + 40 single blocks of 3072 (80 layer-equivalents).
        TransformerSpec(
            name="hunyuanvideo-720p",
            layers=80,
            hidden=3072,
            heads=24,
            ffn=4 * 3072,
            tokens=33 * 45 * 80 + 256,
            extra_layer_params=6 * 3072**2,
            params=13_000_000_000,
            host_ops_per_layer=HUNYUAN_OPS,
            decode_flops=2473.5e12,
            source="HunyuanVideo paper (13B), 720p x 129 frames (960x960 has the same 118,800 tokens)",
        ),
        # CogVideoX-5B (the transformer ConsisID fine-tunes: its README) at 720x480, 49 frames:
        # latent 13 x 60 x 90, 2x2 patches -> 17,550 tokens + 226 text tokens of joint
        # attention; 42 layers of 48 heads x 64; adaLN-zero from a 512-wide time embedding
        # (two 512 x 6h modulations per layer, on the conditioning vector only). Not counted:
        # ConsisID's face extractor and its perceiver cross-attention every second layer, the
        # T5 text encoder, and the host time outside the transformer.
        TransformerSpec(
            name="cogvideox-5b-480p-49f",
            layers=42,
            hidden=3072,
            heads=48,
            ffn=4 * 3072,
            tokens=13 * 30 * 45 + 226,
            extra_layer_params=2 * 512 * 6 * 3072,
            host_ops_per_layer=COGVIDEOX_OPS,
            decode_flops=315.0e12,
            source="CogVideoX-5B transformer (42 layers, 48 heads x 64, rotary), 49 frames of 480x720",
        ),
        *(_moe_preset(name) for name in MOE_CONFIGS),
    )
}


# What each generation preset's estimate counts of the real pipeline, and what it does not
# (the text encoders run once per prompt before sampling; none is counted yet).
PIPELINE_COUNTS: dict[str, dict[str, str]] = {
    "bench-dit": {
        "counted": "the DiT's sampling steps, as tessera bench dit times them",
        "not counted": "nothing else runs in that benchmark's timed loop",
    },
    "pixart-alpha": {
        "counted": "the transformer's steps",
        "not counted": "T5-XXL text encoder, VAE decode, host time per eager op",
    },
    "flux-dev": {
        "counted": "the transformer's steps, VAE decode (10.47 TFLOP), host time (158/83 ops per block)",
        "not counted": "T5-XXL and CLIP text encoders",
    },
    "sana-1600m-4k": {
        "counted": "the transformer's steps, DC-AE decode (133.9 TFLOP), host time (99 ops per block)",
        "not counted": "Gemma-2 text encoder",
    },
    "hunyuanvideo-720p": {
        "counted": "the transformer's steps, 3D VAE decode (2473.5 TFLOP), host time (162/98 ops per block)",
        "not counted": "LLaVA-Llama and CLIP text encoders",
    },
    "cogvideox-5b-480p-49f": {
        "counted": "the transformer's steps, VAE decode (315.0 TFLOP), host time (116 ops per block)",
        "not counted": "T5-XXL text encoder; for ConsisID its face extractor and perceiver cross-attention",
    },
}
