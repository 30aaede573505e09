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
their gradients are summed after each step, so the two copies stay equal. The stages
themselves (where to cut, how each runs, the check that they reproduce the model's forward)
are ``tessera.parallel.stages``; this module trains them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from tessera.parallel.stages import (  # noqa: F401  (re-exported: the stages are part of this API)
    DecoderStage,
    DiTStage,
    balanced_counts,
    build_stage,
    check_stages,
    layer_costs,
    num_layers,
    stage_bounds,
)
from tessera.runtime import Mesh

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


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
