"""Cutting a model into pipeline stages and running them as its own forward does: where to
cut (``stage_bounds``, ``balanced_counts`` by ``layer_costs``), the stages of a transformers
causal LM (``DecoderStage``: GPT-2 or Llama-style module paths, found by ``_paths``) and of
Tessera's DiT (``DiTStage``), and ``check_stages``, which refuses a family whose stages would
not reproduce its forward. ``tessera.parallel.pipeline`` trains them on torch's pipelining.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch import nn


def stage_bounds(
    num_layers: int, stages: int, counts: tuple[int, ...] | None = None
) -> list[tuple[int, int]]:
    """[first, last) layer of each stage: ``counts`` layers each, or as even as possible
    (the first ``num_layers % stages`` stages get one more)."""
    if counts is None:
        if stages > num_layers:
            raise ValueError(f"{num_layers} layers cannot fill {stages} pipeline stages")
        base, extra = divmod(num_layers, stages)
        counts = tuple(base + (i < extra) for i in range(stages))
    if len(counts) != stages or min(counts) < 1 or sum(counts) != num_layers:
        raise ValueError(
            f"stage layer counts {tuple(counts)} must be {stages} positive numbers summing to {num_layers}"
        )
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def balanced_counts(
    costs: list[float], stages: int, *, first: float = 0.0, last: float = 0.0
) -> tuple[int, ...]:
    """Layers per stage (contiguous, each >= 1) that minimise the costliest stage, where
    ``costs`` are the layers' and ``first`` / ``last`` what the first / last stage carry
    besides (embedding; final norm and head). Exact, by dynamic programming over cuts."""
    n = len(costs)
    if stages > n:
        raise ValueError(f"{n} layers cannot fill {stages} pipeline stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(lo: int, hi: int, s: int) -> float:
        return prefix[hi] - prefix[lo] + (first if s == 0 else 0.0) + (last if s == stages - 1 else 0.0)

    # best[s][i]: (max stage cost, counts) of layers [0, i) over stages 0..s
    best = [{i: (cost(0, i, 0), (i,)) for i in range(1, n - stages + 2)}]
    for s in range(1, stages):
        row = {}
        for i in range(s + 1, n - stages + s + 2):
            row[i] = min(
                (max(best[-1][j][0], cost(j, i, s)), best[-1][j][1] + (i - j,))
                for j in range(s, i)
                if j in best[-1]
            )
        best.append(row)
    return best[-1][n][1]


def layer_costs(model: nn.Module) -> tuple[list[float], float, float]:
    """(per-layer, first-stage extra, last-stage extra) compute estimates: parameters a
    token meets (a matmul costs 2 flops per weight per token); an embedding lookup is
    free, the head is a (vocabulary x width) matmul."""
    if hasattr(model, "blocks") and hasattr(model, "condition"):
        blocks, head = list(model.blocks), model.final
    else:
        base = model.base_model
        blocks, head = list(getattr(base, _paths(base).layers)), model.get_output_embeddings()
    costs = [float(sum(p.numel() for p in b.parameters())) for b in blocks]
    return costs, 0.0, float(sum(p.numel() for p in head.parameters()))


@dataclass(frozen=True)
class _Paths:
    layers: str
    norm: str
    embed: str
    positions: str | None  # GPT-2's learned position embedding
    rotary: str | None  # Llama-style rotary embedding


def _paths(base: nn.Module) -> _Paths:
    """Where a base model keeps its parts, by module path (GPT-2 or Llama-style)."""
    if all(hasattr(base, n) for n in ("wte", "wpe", "h", "ln_f")):
        return _Paths(layers="h", norm="ln_f", embed="wte", positions="wpe", rotary=None)
    if all(hasattr(base, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return _Paths(layers="layers", norm="norm", embed="embed_tokens", positions=None, rotary="rotary_emb")
    raise ValueError(
        f"{type(base).__name__}: pipeline stages need GPT-2 (wte, wpe, h, ln_f) or Llama-style "
        "(embed_tokens, layers, norm, rotary_emb) module paths"
    )


class DecoderStage(nn.Module):
    """Layers [lo, hi) of a causal LM, with the embedding if first and the head if last.

    A stage runs its layers as the base model's forward does: the masks transformers'
    own mask functions build for each layer's kind (``config.layer_types``: full or sliding
    attention; a config with only ``sliding_window`` slides every layer, as Mistral does),
    from the micro-batch's padding mask (``attention_mask``, which the schedule hands every
    stage); rotary embeddings per layer kind where the family has several (Gemma-3); the
    final logit soft-cap (Gemma-2). ``check_stages`` proves at set-up that the stages
    together are the model's own forward, and refuses a family whose forward does more."""

    def __init__(self, model: nn.Module, lo: int, hi: int, *, first: bool, last: bool, sequence=None):
        super().__init__()
        base = model.base_model
        self.paths = p = _paths(base)
        self.config = model.config
        self.first, self.last, self.lo = first, last, lo
        self.sequence = sequence  # (comm, axis, method): this stage's tokens are a sequence slice
        self.layers = nn.ModuleList(getattr(base, p.layers)[lo:hi])
        self.embed = getattr(base, p.embed) if first else None
        self.positions = getattr(base, p.positions) if first and p.positions else None
        self.rotary = getattr(base, p.rotary) if p.rotary else None
        self.norm = getattr(base, p.norm) if last else None
        self.head = model.get_output_embeddings() if last else None

    def _positions(self, local: int, device) -> torch.Tensor:
        """Global positions of this rank's tokens (the whole sequence without sp)."""
        if self.sequence is None:
            return torch.arange(local, device=device)
        from tessera.parallel.sequence import sequence_positions

        comm, axis, method = self.sequence
        return sequence_positions(local, comm.mesh.size(axis), comm.mesh.rank(axis), method).to(device)

    def layer_kind(self, index: int) -> str:
        """ "full_attention" or "sliding_attention" for the model's layer ``index``."""
        kinds = getattr(self.config, "layer_types", None)
        if kinds:
            return kinds[index]
        return "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"

    def _masks(self, x: torch.Tensor, pos: torch.Tensor, attention_mask) -> dict:
        """Each layer kind's mask, built by transformers for the model's attention
        implementation over the whole sequence this stage holds."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        build = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        kinds = {self.layer_kind(self.lo + i) for i in range(len(self.layers))}
        return {
            kind: build[kind](self.config, x, attention_mask, None, position_ids=pos.unsqueeze(0))
            for kind in kinds
        }

    def _rotary(self, x: torch.Tensor, pos: torch.Tensor) -> dict | None:
        """Rotary embeddings per layer kind (Gemma-3 rotates sliding layers by another base)."""
        if self.rotary is None:
            return None
        kinds = {self.layer_kind(self.lo + i) for i in range(len(self.layers))}
        if "layer_type" in inspect.signature(self.rotary.forward).parameters:
            return {kind: self.rotary(x, pos.unsqueeze(0), kind) for kind in kinds}
        shared = self.rotary(x, pos.unsqueeze(0))
        return dict.fromkeys(kinds, shared)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[1]
        pos = self._positions(n, x.device)
        if self.first:
            x = self.embed(x)
            if self.positions is not None:
                x = x + self.positions(pos)
        common = {"position_ids": pos.unsqueeze(0)}
        masks = None
        if self.sequence is not None:  # sequence-parallel attention: masks by global position
            from tessera.parallel.sequence import SP_KWARG, SequenceContext

            comm, axis, method = self.sequence
            valid = None if attention_mask is None else attention_mask.bool()
            common[SP_KWARG] = SequenceContext(comm, axis, method, valid)
        else:
            masks = self._masks(x, pos, attention_mask)
        rotary = self._rotary(x, pos)
        for i, layer in enumerate(self.layers):
            kind = self.layer_kind(self.lo + i)
            kwargs = dict(common)
            if masks is not None:
                kwargs["attention_mask"] = masks[kind]
            if rotary is not None:
                kwargs["position_embeddings"] = rotary[kind]
            x = layer(x, **kwargs)
            x = x[0] if isinstance(x, tuple) else x
        if self.last:
            x = self.head(self.norm(x))
            cap = getattr(self.config, "final_logit_softcapping", None)
            if cap:
                x = torch.tanh(x / cap) * cap
        return x


def check_stages(model: nn.Module, *, tokens: int = 24) -> None:
    """Refuse a causal LM whose pipeline stages would not be its own forward: the stages,
    run one after another on this process, against ``model`` on a padded probe batch (one
    row left-padded, one right-padded, longer than a sliding window where one is set), in
    eval mode and without gradients, so the model is left as it was. Any family whose base
    forward does something the stages do not (a multiplier, a scaled logit, another mask)
    is caught here by name, not trained as a different model."""
    if all(hasattr(model, n) for n in ("blocks", "condition", "embed", "head")):
        return  # Tessera's DiT: DiTStage runs its own methods
    cfg = model.config
    window = getattr(cfg, "sliding_window", None) or 0
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or tokens
    t = min(limit, max(tokens, window + 4))
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    ids = torch.randint(3, max(4, cfg.vocab_size), (2, t), generator=g).to(device)
    mask = torch.ones(2, t, dtype=torch.long, device=device)
    mask[0, : t // 4] = 0  # left padding
    mask[1, t - t // 4 :] = 0  # right padding
    counts = stage_bounds(num_layers(model), 2 if num_layers(model) > 1 else 1)
    stages = [
        DecoderStage(model, lo, hi, first=i == 0, last=i == len(counts) - 1)
        for i, (lo, hi) in enumerate(counts)
    ]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits
            x = ids
            for stage in stages:
                x = stage(x, attention_mask=mask)
    finally:
        model.train(was_training)
    real = mask.bool()
    # fp32: the same kernels on the same inputs; 1e-4 relative leaves room for another
    # mask encoding (additive vs boolean) and nothing for a missing multiplier or window
    if x.shape != expected.shape or not torch.allclose(x[real], expected[real], rtol=1e-4, atol=1e-4):
        diff = float((x[real] - expected[real]).abs().max()) if x.shape == expected.shape else float("nan")
        raise ValueError(
            f"{type(model).__name__}: pipeline stages do not reproduce the model's forward (largest logit "
            f"difference {diff:.3g} on a padded probe batch): its family does something in its forward the "
            "stages do not; train it with pp=1"
        )


class DiTStage(nn.Module):
    """Blocks [lo, hi) of Tessera's DiT. The conditioning vector c travels with the tokens
    from stage to stage (every block's adaLN reads it; its gradient flows back the same way):
    the first stage takes (latents, t, y), the others (tokens, c); the last returns the
    model's output. The stage is a shallow copy of the DiT holding only its blocks (and
    the embeddings / final layer where it is first / last), so the DiT's own methods run."""

    def __init__(self, model: nn.Module, lo: int, hi: int, *, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        dit = copy.copy(model)
        dit._modules = dict(model._modules)  # its own table: the model's stays whole
        dit.blocks = nn.ModuleList(model.blocks[lo:hi])
        for name in ("patch_embed", "t_embed", "y_embed") if not first else ():
            del dit._modules[name]
        if not last:
            del dit._modules["final"]
        self.dit = dit
        self.grid_width = model.config.image_size // model.config.patch_size

    def forward(self, *inputs):
        dit = self.dit
        if self.first:
            x, t, y = inputs
            tokens, c = dit.embed(x), dit.condition(t, y)
        else:
            tokens, c = inputs
        for block in dit.blocks:
            tokens = block(tokens, c)
        return dit.head(tokens, c, self.grid_width) if self.last else (tokens, c)


def build_stage(model: nn.Module, lo: int, hi: int, *, first: bool, last: bool, sequence=None) -> nn.Module:
    """The stage module for ``model``: a DiT (``blocks`` + ``condition``/``embed``/``head``)
    or a transformers causal LM (``sequence``: its tokens split over that sp axis)."""
    if all(hasattr(model, n) for n in ("blocks", "condition", "embed", "head")):
        if sequence is not None:
            raise ValueError(
                "sequence parallel pipeline stages are built for transformers causal LMs, not the DiT"
            )
        return DiTStage(model, lo, hi, first=first, last=last)
    return DecoderStage(model, lo, hi, first=first, last=last, sequence=sequence)


def num_layers(model: nn.Module) -> int:
    if hasattr(model, "blocks") and hasattr(model, "condition"):
        return len(model.blocks)
    return len(getattr(model.base_model, _paths(model.base_model).layers))
