"""A tiny Wan 2.1 text-to-video pipeline (random weights), saved with save_pretrained like a
user's download: UMT5 text encoder, WanTransformer3DModel, AutoencoderKLWan, UniPC."""

from pathlib import Path

import torch
from parity import perturbed
from tiny_pipelines import WORDS, tiny_t5_tokenizer


def tiny_wan_transformer(layers: int = 3):
    from diffusers import WanTransformer3DModel

    return perturbed(
        WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,  # rotary: 4 dims each for frame, row and column
            in_channels=4,
            out_channels=4,
            text_dim=24,
            freq_dim=16,
            ffn_dim=32,
            num_layers=layers,
            cross_attn_norm=True,
            rope_max_seq_len=32,
        )
    )


def tiny_wan_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 2.0, 0.8, 1.2],
        scale_factor_temporal=2,
        scale_factor_spatial=4,
    ).eval()


def build_wan_pipeline(directory: Path, *, seed: int = 0) -> Path:
    from diffusers import UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(WORDS) + 3, d_model=24, d_ff=32, num_layers=1, num_heads=2, d_kv=12)
    ).eval()
    pipe = WanPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=text_encoder,
        vae=tiny_wan_vae(),
        transformer=tiny_wan_transformer(),
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
    )
    pipe.save_pretrained(directory)
    return directory
