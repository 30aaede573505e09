"""Export a boosted model as a HuggingFace ``save_pretrained`` folder.

Every rank takes part (the full tensors are gathered: stage 3 chunks over ``dp``, DTensor
shards over ``tp``, pipeline stages over ``pp``); one rank writes. Layout changes a tensor parallel plan made (GPT-2's
Conv1D turned into Linear, its fused q|k|v rows reordered by rank) are undone, so the
folder loads with the model class's own ``from_pretrained``. Written to a temporary folder
and renamed into place: a crash never leaves a half-written export under the final name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn


def full_state_dict(model: nn.Module, optimizer=None) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole, in the model class's own layout (a collective).
    ``optimizer``: what ``boost`` returned with ``model`` (a ``TrainOptimizer``, whose
    ``full_state`` gathers ZeRO-3 chunks, tp shards and pipeline stages); None for a plain
    model or its plain torch optimizer (DTensor shards gathered)."""
    from tessera.train.optimizer import TrainOptimizer

    if isinstance(optimizer, TrainOptimizer):
        state = optimizer.full_state()
    else:
        state = {}
        for name, t in model.state_dict(keep_vars=True).items():
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            state[name] = full.detach().clone()
    degree = getattr(model, "_tessera_gpt2_tp_degree", None)
    if degree is not None:
        state = gpt2_hf_layout(model, state, degree)
    return state


def gpt2_hf_layout(model: nn.Module, state: dict[str, torch.Tensor], degree: int) -> dict[str, torch.Tensor]:
    """Undo ``prepare_gpt2``: Linear weights back to Conv1D's (in x out), q|k|v rows back in order."""
    return {name: gpt2_tensor_layout(name, t, degree, to_hf=True) for name, t in state.items()}


_GPT2_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def gpt2_tensor_layout(name: str, t: torch.Tensor, degree: int, *, to_hf: bool) -> torch.Tensor:
    """One GPT-2 tensor between HF's layout and ``prepare_gpt2``'s at tensor parallel ``degree``
    (``to_hf`` False: HF -> prepared). Other tensors pass through."""
    from tessera.parallel.tp_plans import gpt2_qkv_rows

    layer = next(
        (k for k in _GPT2_LINEARS if name.endswith(f".{k}.weight") or name.endswith(f".{k}.bias")), None
    )
    if layer is None or ".h." not in name:
        return t
    is_weight = name.endswith(".weight")
    if not to_hf and is_weight:
        t = t.t()
    if layer == "attn.c_attn":
        rows = gpt2_qkv_rows(t.shape[0] // 3, degree)
        if to_hf:
            inverse = torch.empty_like(rows)
            inverse[rows] = torch.arange(len(rows))
            t = t[inverse]
        else:
            t = t[rows]
    if to_hf and is_weight:
        t = t.t()
    return t.contiguous()


NO_TOKENIZER = """# No tokenizer in this folder

This folder holds a model exported by Tessera (its `config.json` and weights) without the
tokenizer it was trained with: `AutoTokenizer.from_pretrained` on this folder will not give
the right one. Save that tokenizer beside these files (`tokenizer.save_pretrained(folder)`)
to make the folder whole.
"""


def save_hf(model: nn.Module, optimizer, path: str | os.PathLike, *, is_writer: bool, tokenizer=None) -> None:
    """Gather on every rank; ``is_writer`` writes ``path`` (atomically) with save_pretrained,
    with ``tokenizer`` (anything with ``save_pretrained``) beside the weights, or, where none
    is given, a README.md saying the folder has no tokenizer."""
    state = full_state_dict(model, optimizer)
    if not is_writer:
        return
    config = model.config
    fresh = type(model)(config)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith(tuple(_tied_names(fresh)))]:
        raise RuntimeError(
            f"export does not match {type(model).__name__}: missing {missing}, unexpected {unexpected}"
        )
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    fresh.save_pretrained(partial)
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)
    else:
        (partial / "README.md").write_text(NO_TOKENIZER)
    if path.exists():
        shutil.rmtree(path)
    os.replace(partial, path)


def _tied_names(model: nn.Module) -> list[str]:
    seen, tied = {}, []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.append(name)
        seen.setdefault(id(p), name)
    return tied
