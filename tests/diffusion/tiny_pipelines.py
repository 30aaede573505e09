"""Tiny diffusers pipelines built offline from configs (random weights, a word-level
tokenizer made in code), saved with save_pretrained like a user's download would be."""

from pathlib import Path

import torch
from parity import perturbed

WORDS = "a an the photo of cat dog red blue green small large painting sky sea tree house".split()


def tiny_t5_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_pixart_transformer():
    from diffusers import PixArtTransformer2DModel

    return perturbed(
        PixArtTransformer2DModel(
            sample_size=8,
            num_layers=3,
            attention_head_dim=8,
            num_attention_heads=4,
            in_channels=4,
            out_channels=8,
            cross_attention_dim=32,
            caption_channels=24,
            patch_size=2,
            norm_type="ada_norm_single",
            num_embeds_ada_norm=1000,
        )
    )


def build_pixart_pipeline(directory: Path, *, seed: int = 0) -> Path:
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=len(WORDS) + 3, d_model=24, d_ff=32, num_layers=1, num_heads=2, d_kv=12)
    ).eval()
    transformer = tiny_pixart_transformer()
    pipe = PixArtAlphaPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=text_encoder,
        vae=_tiny_vae(4),
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    )
    pipe.save_pretrained(directory)
    return directory


def _tokenizer(max_length: int):
    tok = tiny_t5_tokenizer()
    tok.model_max_length = max_length
    return tok


def _tiny_clip(hidden: int, projection: int, *, with_projection: bool = True):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(WORDS) + 3,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        projection_dim=projection,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
    )
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config).eval()


def _tiny_t5(d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(vocab_size=len(WORDS) + 3, d_model=d_model, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    ).eval()


def _tiny_vae(latent_channels: int, **extra):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=32,
        **extra,
    )


def build_sd3_pipeline(directory: Path, *, seed: int = 0) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    transformer = perturbed(
        SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=32,
            caption_projection_dim=32,
            pooled_projection_dim=16,
            out_channels=4,
            pos_embed_max_size=16,
        )
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_tiny_vae(4, shift_factor=0.1),
        text_encoder=_tiny_clip(16, 8),
        tokenizer=_tokenizer(12),
        text_encoder_2=_tiny_clip(16, 8),
        tokenizer_2=_tokenizer(12),
        text_encoder_3=_tiny_t5(32),
        tokenizer_3=_tokenizer(12),
    )
    pipe.save_pretrained(directory)
    return directory


def build_flux_pipeline(directory: Path, *, seed: int = 0) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = perturbed(
        FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=32,
            pooled_projection_dim=16,
            guidance_embeds=True,
            axes_dims_rope=(2, 2, 4),
        )
    )
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=_tiny_vae(4, shift_factor=0.1),
        text_encoder=_tiny_clip(16, 8, with_projection=False),
        tokenizer=_tokenizer(12),
        text_encoder_2=_tiny_t5(32),
        tokenizer_2=_tokenizer(12),
    )
    pipe.save_pretrained(directory)
    return directory
