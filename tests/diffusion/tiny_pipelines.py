"""Tiny diffusers pipelines built offline from configs (random weights, a word-level
tokenizer made in code), saved with save_pretrained like a user's download would be."""

from pathlib import Path

import torch

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


def build_pixart_pipeline(directory: Path, *, seed: int = 0) -> Path:
    from diffusers import (
        AutoencoderKL,
        DPMSolverMultistepScheduler,
        PixArtAlphaPipeline,
        PixArtTransformer2DModel,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=len(WORDS) + 3, d_model=24, d_ff=32, num_layers=1, num_heads=2, d_kv=12)
    ).eval()
    transformer = PixArtTransformer2DModel(
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
    with torch.no_grad():
        for p in transformer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=32,
    )
    pipe = PixArtAlphaPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    )
    pipe.save_pretrained(directory)
    return directory
