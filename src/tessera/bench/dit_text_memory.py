"""The text encoder held once (#31 item 3), measured per rank: `tessera bench dit-video`'s
text-encoder table.

``tessera generate`` loads a pipeline's text encoder on rank 0 alone (``load_pipeline(...,
with_text_encoder=global_rank() == 0)``); rank 0 encodes the prompts and broadcasts the
embeddings. Each way of loading, every rank loading the encoder ("before") and rank 0 alone
("after"), runs in its own two fresh processes, and each rank reports:

* the parameter bytes of the loaded pipeline it holds (exact; the property a test checks);
* its resident memory (VmRSS) after the same imports (every component's class, loaded or
  not, and Tessera's pipeline code), after loading and reading every weight once (as a
  rank that runs the modules does: weights loaded from safetensors can stay pages of the
  mapped file until read), and what loading added to it.

The pipeline is a saved PixArt whose T5 encoder (4 layers, width 512) outweighs its
transformer, as T5-XXL outweighs PixArt's.
"""

from __future__ import annotations

import gc
import importlib
import json
from pathlib import Path

import torch

MIB = 2**20


def held_parameter_bytes(pipe) -> int:
    """Bytes of every parameter of the pipeline's modules (text encoder, transformer, VAE)."""
    return sum(
        p.numel() * p.element_size()
        for c in pipe.components.values()
        if isinstance(c, torch.nn.Module)
        for p in c.parameters()
    )


@torch.no_grad()
def _touch(pipe) -> None:
    """Read every parameter and buffer once, as running the modules does: weights loaded
    from a safetensors file may stay pages of the mapped file, resident only once read."""
    for c in pipe.components.values():
        if isinstance(c, torch.nn.Module):
            for t in (*c.parameters(), *c.buffers()):
                t.sum()


def _import_components(directory: str) -> None:
    """Import the class of every component the folder names (diffusers and transformers load
    their model modules lazily), so both ways of loading start from the same imports."""
    index = json.loads((Path(directory) / "model_index.json").read_text())
    for value in index.values():
        if isinstance(value, list) and len(value) == 2 and value[0]:
            getattr(importlib.import_module(value[0]), value[1])


def _rank_memory(directory: str, every_rank: bool) -> dict:
    """On one rank: resident bytes after the imports and after loading the pipeline (with
    its text encoder on every rank, or on rank 0 alone) and reading its weights, and the
    parameter bytes held."""
    from tessera.diffusion.pipelines import load_pipeline
    from tessera.memory.track import resident_bytes
    from tessera.runtime.mesh import global_rank

    _import_components(directory)
    gc.collect()
    imports = resident_bytes()
    pipe = load_pipeline(directory, with_text_encoder=every_rank or global_rank() == 0)
    pipe.set_progress_bar_config(disable=True)
    _touch(pipe)
    gc.collect()
    return {
        "params": held_parameter_bytes(pipe),
        "rss_imports": imports,
        "rss_loaded": resident_bytes(),
        "text_encoder": getattr(pipe, "text_encoder", None) is not None,
    }


def measure_text_encoder_memory(directory: str, ranks: int = 2, fresh: bool = True) -> dict[str, list[dict]]:
    """{"before": every rank loading the encoder, "after": rank 0 alone}: per rank, what
    ``_rank_memory`` reports, each way in its own fresh processes (``fresh``; a pooled rank's
    resident memory holds what earlier calls left, its parameter bytes do not)."""
    from tessera.runtime import spawn

    return {
        way: spawn(_rank_memory, ranks, directory, way == "before", fresh=fresh, timeout_s=600)
        for way in ("before", "after")
    }


def text_memory_rows(measured: dict[str, list[dict]]) -> list[dict]:
    """One row per rank: parameter MiB, resident MiB after loading, resident MiB the load
    added, before and after holding the encoder once."""
    rows = []
    for r, (before, after) in enumerate(zip(measured["before"], measured["after"], strict=True)):
        rows.append(
            {
                "rank": r,
                "params_mib_before": round(before["params"] / MIB, 2),
                "params_mib_after": round(after["params"] / MIB, 2),
                "rss_mib_before": round(before["rss_loaded"] / MIB, 1),
                "rss_mib_after": round(after["rss_loaded"] / MIB, 1),
                "rss_added_mib_before": round((before["rss_loaded"] - before["rss_imports"]) / MIB, 1),
                "rss_added_mib_after": round((after["rss_loaded"] - after["rss_imports"]) / MIB, 1),
            }
        )
    return rows


TEXT_COLUMNS = [
    "rank",
    "params_mib_before",
    "params_mib_after",
    "rss_mib_before",
    "rss_mib_after",
    "rss_added_mib_before",
    "rss_added_mib_after",
]
TEXT_NOTE = (
    "text encoder: a saved PixArt pipeline with a 4-layer width-512 T5; before: every rank loads the "
    "encoder, after: rank 0 alone (tessera generate); each way in 2 fresh processes. params: parameter "
    "bytes held; rss: the process's resident memory (VmRSS) after loading and reading every weight once; "
    "rss_added: what that added to the resident memory after the same imports (every component's class)"
)


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "a the cat dog red blue photo of".split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def text_pipeline(directory: Path) -> str:
    """A saved PixArt pipeline whose T5 encoder (4 layers, width 512) outweighs its
    transformer, as T5-XXL outweighs PixArt's."""
    from diffusers import (
        AutoencoderKL,
        DPMSolverMultistepScheduler,
        PixArtAlphaPipeline,
        PixArtTransformer2DModel,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    pipe = PixArtAlphaPipeline(
        tokenizer=_word_tokenizer(),
        text_encoder=T5EncoderModel(
            T5Config(vocab_size=11, d_model=512, d_ff=2048, num_layers=4, num_heads=8, d_kv=64)
        ).eval(),
        vae=AutoencoderKL(latent_channels=4, block_out_channels=(32,), norm_num_groups=8),
        transformer=PixArtTransformer2DModel(
            sample_size=8,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            in_channels=4,
            out_channels=8,
            cross_attention_dim=64,
            caption_channels=512,
            norm_type="ada_norm_single",
            num_embeds_ada_norm=1000,
        ),
        scheduler=DPMSolverMultistepScheduler(),
    )
    pipe.save_pretrained(directory)
    return str(directory)
