"""Pipeline-parallel training of transformers causal LMs and Tessera's DiT on
torch.distributed.pipelining.

The model is cut into stages by module path, without editing its code: stage s holds the
embedding (first stage), the decoder layers [lo, hi) of ``<base>.<layers>`` and the final
norm and LM head (last stage). A stage runs its layers as the base model's forward does
(GPT-2: token + position embeddings; Llama-style: rotary position embeddings computed
from the stage's input), with an explicit causal mask. torch's pipelining runs the
schedule (GPipe, 1F1B, interleaved 1F1B with virtual stages): its schedules and p2p are
tested on CPU/gloo (../shared/TORCH_ON_CPU.md), so there is nothing to gain from writing
them again. A head tied to the embedding (GPT-2) lives on the first and the last stage;
their gradients are summed after each step, so the two copies stay equal.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from tessera.runtime import Mesh

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


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


class _Autocast(nn.Module):
    """A stage whose forward (and so its recomputation in backward) runs under autocast."""

    def __init__(self, stage: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.stage, self.dtype = stage, dtype

    def forward(self, *inputs, **kwargs):
        device = next(self.stage.parameters()).device.type
        with torch.autocast(device_type=device, dtype=self.dtype):
            return self.stage(*inputs, **kwargs)


class PipelineTrainer:
    """One rank's stages and the schedule. ``model`` is built identically on every rank
    (same seed); each rank keeps only its stages' modules. With a ``dp`` axis on the mesh,
    each replica pipelines its own share of the batch and the stages' gradients are
    averaged over ``dp`` after the schedule (ZeRO stage 0). ``autocast``: a dtype the stages'
    forwards run in (bf16 with fp32 weights); ``sequence`` (comm, axis, method): each stage's
    tokens are this rank's slice of the sequence and attention is sequence-parallel over
    that axis (``tessera.parallel.sequence``)."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        loss_fn,
        *,
        microbatches: int,
        schedule: str = "1f1b",
        virtual_stages: int = 1,
        counts: tuple[int, ...] | str | None = None,
        axis: str = "pp",
        dp_axis: str | None = "dp",
        autocast: torch.dtype | None = None,
        sequence: tuple | None = None,
        experts: tuple | None = None,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if schedule != "interleaved" and virtual_stages != 1:
            raise ValueError(f"virtual_stages={virtual_stages} needs schedule='interleaved'")
        pp, me = mesh.size(axis), mesh.rank(axis)
        total = pp * virtual_stages
        if counts == "balanced":
            costs, first, last = layer_costs(model)
            counts = balanced_counts(costs, total, first=first, last=last)
        bounds = stage_bounds(num_layers(model), total, counts)
        ids = [me + pp * v for v in range(virtual_stages)]  # interleaved: stage i on rank i % pp
        self.mesh, self.axis, self.pp = mesh, axis, pp
        self.dp_axis = dp_axis if dp_axis in mesh.names and mesh.size(dp_axis) > 1 else None
        self.modules = [
            build_stage(model, *bounds[i], first=i == 0, last=i == total - 1, sequence=sequence) for i in ids
        ]
        group = mesh.group(axis)
        run = self.modules if autocast is None else [_Autocast(m, autocast) for m in self.modules]
        stages = [PipelineStage(m, i, total, mesh.device, group=group) for m, i in zip(run, ids, strict=True)]
        kind = SCHEDULES[schedule]
        self.schedule = kind(
            stages if schedule == "interleaved" else stages[0], microbatches, loss_fn=loss_fn
        )
        self.tied = self._tied(model)
        # (comm of the expert mesh, ids of expert parameters): those are summed over "edp"
        self.experts = experts

    def _tied(self, model) -> bool:
        if not hasattr(model, "get_output_embeddings"):  # the DiT ties nothing
            return False
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        self.tied_shape = tuple(embed.weight.shape)
        return head is not None and head.weight is embed.weight and self.pp > 1

    def parameters(self):
        seen = {}
        for m in self.modules:
            for p in m.parameters():
                seen[id(p)] = p
        return list(seen.values())

    def step(self, inputs, labels: torch.Tensor, **kwargs) -> torch.Tensor | None:
        """Forward and backward of one batch (``inputs``: the model's input, or a tuple of
        them: the DiT's (latents, t, y)), gradients averaged over micro-batches; the mean
        loss on the last stage's rank, None elsewhere. ``kwargs`` (e.g. the batch's
        ``attention_mask``) reach every stage, split into the same micro-batches."""
        losses: list = []
        first = any(m.first for m in self.modules)
        last = any(m.last for m in self.modules)
        args = (inputs if isinstance(inputs, tuple) else (inputs,)) if first else ()
        self.schedule.step(*args, target=labels if last else None, losses=losses, **kwargs)
        if self.tied:
            self._sum_tied_grads(first, last)
        if self.dp_axis is not None:
            self._average_over_dp()
        return torch.stack(losses).mean() if last else None

    def _average_over_dp(self) -> None:
        """Each dp replica ran its share of the batch: average the stage's gradients over
        ``dp`` in one flat all-reduce. Expert parameters (``experts``) are summed over the
        ``edp`` ranks holding the same experts and divided by dp: their local gradient already
        sums the tokens of the whole ep group (``tessera.parallel.zero`` says why)."""
        expert_ids = self.experts[1] if self.experts else set()
        with_grad = [p for p in self.parameters() if p.grad is not None]
        dense = [_local(p.grad) for p in with_grad if id(p) not in expert_ids]  # tp: this rank's shard
        _reduce_flat(dense, lambda flat: self.mesh.comm.all_reduce(flat, self.dp_axis, op="avg"))
        if self.experts:
            comm, dp = self.experts[0], self.mesh.size(self.dp_axis)

            def expert_sum(flat):
                comm.all_reduce(flat, "tp")  # each tp rank dispatched its slice of the tokens
                comm.all_reduce(flat, "edp")  # size 1 when dp == ep: no message
                flat.div_(dp)

            _reduce_flat([_local(p.grad) for p in with_grad if id(p) in expert_ids], expert_sum)

    def _sum_tied_grads(self, first: bool, last: bool) -> None:
        """The embedding's gradient on the first stage and the head's on the last are two
        halves of one parameter's: every rank of the axis all-reduces (zeros in between)."""
        weight = None
        for m in self.modules:
            if m.first and first:
                weight = m.embed.weight
            elif m.last and last:
                weight = m.head.weight
        if weight is None:
            grad = torch.zeros(self.tied_shape, device=self.mesh.device)
        else:
            grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        total = grad.clone()
        self.mesh.comm.all_reduce(total, self.axis)
        if weight is not None:
            weight.grad = total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _reduce_flat(grads: list[torch.Tensor], reduce) -> None:
    """``reduce`` (in place) the gradients as one flat tensor, written back."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    reduce(flat)
    for g, new in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(new.view_as(g))
