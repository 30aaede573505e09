"""LoRA adapters on a diffusers pipeline, checked before they are loaded.

The pipeline's own ``load_lora_weights`` (diffusers + peft) does the loading: peft wraps
the targeted linear layers, whose forward then adds the low-rank update, so Tessera's
processors (which call ``to_q``/``to_k``/``to_v``/``to_out``) and every parallel method run
the LoRA model as they run the base model; ``fuse`` merges the update into the weights.
What diffusers does not do is refuse a LoRA whose target modules the model lacks (it loads
what matches and drops the rest with at most a warning): ``check_lora`` refuses it by name.
"""

from __future__ import annotations

from pathlib import Path


def _state_dict(pipe, directory: str | Path) -> dict:
    state = pipe.lora_state_dict(str(directory))
    return state[0] if isinstance(state, tuple) else state  # some loaders add network alphas


def check_lora(pipe, directory: str | Path) -> None:
    """A ValueError naming the first LoRA module ``pipe`` cannot take (works on a
    ``meta_pipeline`` too: only module names are read)."""
    name = type(pipe).__name__
    if not hasattr(pipe, "load_lora_weights"):
        raise ValueError(
            f"--lora: {name} does not load LoRA weights (diffusers gives it no load_lora_weights)"
        )
    if not Path(directory).exists():
        raise ValueError(f"--lora {directory}: no such file or folder")
    modules = dict(pipe.transformer.named_modules())
    for key in _state_dict(pipe, directory):
        component, _, rest = key.partition(".")
        if component != "transformer":
            raise ValueError(
                f"--lora {directory} adapts {key.split('.lora')[0]}; Tessera loads LoRAs for the transformer "
                "only (the text encoders run on one rank)"
            )
        path = rest.split(".lora_")[0]
        if path not in modules:
            raise ValueError(
                f"--lora {directory} targets transformer.{path}, which this {type(pipe.transformer).__name__} "
                "does not have (a LoRA for another model or size?)"
            )


def load_lora(pipe, directory: str | Path, *, fuse: bool = False) -> None:
    """Check, then load the LoRA in ``directory`` into ``pipe`` (merged into the weights when
    ``fuse``)."""
    check_lora(pipe, directory)
    pipe.load_lora_weights(str(directory))
    if fuse:
        pipe.fuse_lora()
