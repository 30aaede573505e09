"""A tiny LTX-Video pipeline (random weights), saved with save_pretrained like a user's
download: T5 text encoder, LTXVideoTransformer3DModel, AutoencoderKLLTXVideo, flow Euler."""

from pathlib import Path

import torch
from parity import perturbed
from tiny_pipelines import WORDS, tiny_t5_tokenizer


def tiny_ltx_transformer(layers: int = 3):
    from diffusers import LTXVideoTransformer3DModel

    return perturbed(
        LTXVideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=2,
            attention_head_dim=12,
            cross_attention_dim=24,
            num_layers=layers,
            caption_channels=24,
        )
    )


def tiny_ltx_vae():
    from diffusers import AutoencoderKLLTXVideo

    # patch 2 x 2, one spatio-temporal downsampling: 4x in space, 2x in time
    return AutoencoderKLLTXVideo(
        latent_channels=8,
        block_out_channels=(8, 16),
        down_block_types=("LTXVideoDownBlock3D",) * 2,
        decoder_block_out_channels=(8, 16),
        layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, False),
        decoder_spatio_temporal_scaling=(True, False),
        decoder_inject_noise=(False, False, False),
        downsample_type=("conv", "conv"),
        upsample_residual=(False, False),
        upsample_factor=(1, 1),
        patch_size=2,
        patch_size_t=1,
    ).eval()


def build_ltx_pipeline(directory: Path, *, seed: int = 0) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    pipe = LTXPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=T5EncoderModel(
            T5Config(vocab_size=len(WORDS) + 3, d_model=24, d_ff=32, num_layers=1, num_heads=2, d_kv=12)
        ).eval(),
        vae=tiny_ltx_vae(),
        transformer=tiny_ltx_transformer(),
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
    )
    pipe.save_pretrained(directory)
    return directory
