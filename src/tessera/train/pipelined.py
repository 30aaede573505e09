"""``boost`` under ``Plan(pp > 1)``: each rank keeps its pipeline stages of the model, the
user's optimizer steps their parameters, and ``train_step`` runs one schedule
(``tessera.parallel.pipeline.PipelineTrainer`` on torch.distributed.pipelining) over the
rank's dp share of the batch, cut into ``Plan.microbatches``.

The mesh is (pp, dp, tp), tensor parallel innermost. Gradients are averaged over dp after
the schedule, the tied embedding / head gradient summed over the first and last stage,
and the global gradient norm (for ``max_grad_norm``) summed over the stages with a tied
weight counted once. Parameters of other ranks' stages are released: a rank holds only
its stages, which is what pipeline parallelism is for.

With ``Plan(ep)`` each stage's experts are split over the ep ranks of its dp row: their
gradients are summed over the ranks holding the same experts (edp) and divided by dp, each
rank steps its own experts (at ZeRO-1 only the dense parameters are shared out over dp), and
the global norm counts each expert once (summed over ep).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from tessera.memory.clip import clip_coefficient
from tessera.parallel.pipeline import PipelineTrainer
from tessera.runtime import Mesh
from tessera.train.losses import LabelLoss, PipelineLoss, SequenceLoss
from tessera.train.optimizer import PlanOptimizer
from tessera.train.stage_engine import StageEngine, local_tensor

AUTOCAST = {"bf16": torch.bfloat16}


class PipelinedOptimizer(PlanOptimizer):
    """What ``boost`` returns as the optimizer under ``Plan(pp > 1)`` (a ``TrainOptimizer``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        plan,
        mesh: Mesh,
        *,
        experts=None,
        group_names: list[list[str]] | None = None,
    ):
        self.model, self.plan, self.mesh, self.inner = model, plan, mesh, optimizer
        # parameter names of each of the user's groups (as the user built them)
        self.group_names = group_names or [[n for n, _ in model.named_parameters()]]
        # Plan(ep): (expert mesh, expert parameters): each stage's experts split over its ep ranks
        self.expert_mesh = experts[0] if experts else None
        self.expert_ids = {id(p) for p in experts[1]} if experts else set()
        self._loss = None  # the loss of the train_step running now (the schedule calls it)
        self.trainer = PipelineTrainer(
            model,
            mesh,
            self._stage_loss,
            microbatches=plan.microbatches,
            schedule=plan.schedule,
            virtual_stages=plan.virtual_stages,
            counts=plan.stage_layers,
            dp_axis="dp",
            autocast=AUTOCAST.get(plan.precision),
            sequence=self._sequence(model, plan, mesh),
            experts=None if experts is None else (self.expert_mesh.comm, self.expert_ids),
        )
        kept = {id(p) for p in self.trainer.parameters()}
        # ZeRO-1: each dp rank steps (and keeps optimizer states for) its share of the stage's
        # parameters, then sends the updated values to the other replicas.
        # Expert parameters differ between the ep ranks of a dp row: each rank steps its own.
        dense = [p for p in self.trainer.parameters() if id(p) not in self.expert_ids]
        self.owner_rank = _partition(dense, mesh.size("dp") if plan.zero else 1)
        mine = {i for i, r in self.owner_rank.items() if r == (mesh.rank("dp") if plan.zero else 0)}
        mine |= self.expert_ids
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in kept and id(p) in mine]
        # a checkpoint records the model's own shapes, whichever stages a rank holds
        self.param_shapes = {
            n: list(p.shape)
            for n, p in model.named_parameters()
            if id(p) not in kept and not hasattr(p, "to_local")
        }
        _release(model, kept)
        self.engine = StageEngine(self.trainer.parameters(), optimizer, zero=plan.zero)
        self.last_grad_norm: float | None = None
        self.loss_scaler = None  # fp16 is refused under pp

    @staticmethod
    def _sequence(model, plan, mesh):
        """pp x sp: the stages' attention runs sequence-parallel over the sp axis."""
        if plan.sp == 1:
            return None
        from tessera.parallel.sequence import check_sequence_parallel, use_sequence_parallel_attention

        check_sequence_parallel(model)
        use_sequence_parallel_attention(model)  # the layers look it up per call
        return (mesh.comm, "sp", plan.sp_method)

    def _sequence_split(self, local, loss_fn, denominator: float):
        """This sp rank's (input ids, next-token labels); the loss becomes the stage's share
        of the global mean (the labels made before the split, as SequenceParallel does)."""
        if not isinstance(loss_fn, SequenceLoss):
            raise ValueError(
                f"Plan(pp={self.plan.pp}, sp={self.plan.sp}) splits each sequence over ranks: {loss_fn!r} has no "
                "sequence_parallel method (use tessera.train.losses.causal_lm_loss)"
            )
        from tessera.parallel.sequence import next_token_labels, sequence_shard, token_batch

        ids, mask = token_batch(local)
        ids, labels, _ = sequence_shard(
            ids, self.mesh.size("sp"), self.mesh.rank("sp"), self.plan.sp_method, next_token_labels(ids, mask)
        )
        return ids, labels, LabelLoss(denominator)

    def _denominator(self, batch, loss_fn) -> float | None:
        """The global count of labelled tokens over the micro-batches x replicas the step
        averages (``tessera.train.losses``): a padded batch, or a sequence split over sp
        (whose slices' counts differ); None where each micro-batch's mean is exact."""
        count = loss_fn.token_count(batch) if hasattr(loss_fn, "token_count") else None
        if count is None and self.plan.sp > 1:
            from tessera.parallel.sequence import next_token_labels, token_batch

            ids, mask = token_batch(batch)
            count = int((next_token_labels(ids, mask) != -100).sum())
        if count is None:
            return None
        if count == 0:
            raise ValueError("the batch has no labelled token (every position is padding or a row's last)")
        return count / (self.plan.microbatches * self.mesh.size("dp"))

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer whole (a collective over the pipeline): each tensor
        from the last pp rank holding it (a tied weight sits on two), zeros elsewhere, summed."""
        state = self.model.state_dict(keep_vars=True)
        me, kept = self.mesh.rank("pp"), set(map(id, self.engine.owner))
        held = lambda t: id(t) in kept or not isinstance(t, nn.Parameter)  # noqa: E731 buffers: every rank
        writer = torch.tensor([me if held(t) else -1 for t in state.values()], device=self.mesh.device)
        self.mesh.comm.all_reduce(writer, "pp", op="max")
        out = {}
        for (name, t), w in zip(state.items(), writer.tolist(), strict=True):
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            shape = self.param_shapes.get(name, list(full.shape))
            value = (
                full.detach().clone()
                if me == w
                else torch.zeros(shape, dtype=t.dtype, device=self.mesh.device)
            )
            self.mesh.comm.all_reduce(value, "pp")
            out[name] = value
        return out

    def _stage_loss(self, output, target):
        return self._loss.on_output(output, target)

    def batch_split(self) -> tuple[int, int, str, int]:
        """This dp replica's share of the global batch, cut into ``Plan.microbatches``."""
        return self.mesh.size("dp"), self.mesh.rank("dp"), "microbatches", self.plan.microbatches

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every stage parameter's gradient (at ZeRO-1 the optimizer holds only a share)."""
        for p in self.trainer.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def train_step(self, batch, loss_fn) -> dict:
        """One schedule over this replica's share of ``batch`` and one optimizer step.
        ``loss_fn`` must split over stages (``pipeline_parts`` / ``on_output``, as
        ``tessera.train.losses.causal_lm_loss`` does). Returns {"loss", "grad_norm", "seconds"}."""
        if not isinstance(loss_fn, PipelineLoss):
            raise ValueError(
                f"Plan(pp={self.plan.pp}) computes the loss on the last stage from the model's output: "
                f"{loss_fn!r} has no pipeline_parts/on_output methods (use tessera.train.losses.causal_lm_loss "
                "or a loss object with both)"
            )
        began = time.perf_counter()
        local = self.local_batch(batch)
        denominator = self._denominator(batch, loss_fn)
        if self.plan.sp > 1:
            inputs, target, stage_loss = self._sequence_split(local, loss_fn, denominator)
        else:
            inputs, target = loss_fn.pipeline_parts(local)
            stage_loss = loss_fn if denominator is None else LabelLoss(denominator)
        # the padding mask reaches every stage (the schedule splits it into micro-batches)
        mask = local.get("attention_mask") if isinstance(local, dict) else None
        self.zero_grad()
        self._loss = stage_loss
        try:
            loss = self.trainer.step(inputs, target, **({} if mask is None else {"attention_mask": mask}))
        finally:
            self._loss = None
        if self.plan.sp > 1:  # each sp rank saw a slice of every sequence: sum the slices
            self._sum_over_sp()
        self.step()
        # the last stage's loss, to every rank of the pipeline; then the mean over replicas
        total = torch.zeros(1, dtype=torch.float64, device=self.mesh.device)
        if loss is not None:
            total += float(loss.detach())
        self.mesh.comm.all_reduce(total, "pp")
        if self.plan.sp > 1:
            self.mesh.comm.all_reduce(total, "sp")  # the slices' shares of the mean
        self.mesh.comm.all_reduce(total, "dp", op="avg")
        return {
            "loss": float(total),
            "grad_norm": self.last_grad_norm,
            "seconds": time.perf_counter() - began,
        }

    def step(self) -> bool:
        """One optimizer step over this rank's stages (clipped to the global norm, at ZeRO-1
        the updates shared over dp); never skipped (fp16 is refused under pp): False."""
        self.last_grad_norm = self._clip()
        self.inner.step()
        if self.plan.zero:
            self._share_updates()
        return False

    def state_dict(self) -> dict:
        """The whole optimizer state in the user's torch optimizer's own format, as
        ``BoostedOptimizer.state_dict`` gives it (a collective: every rank calls it and gets
        it all). Each parameter's states come from one rank stepping it (a tp-sharded one
        gathered over its tp ranks), zeros elsewhere, summed over pp, dp and sp."""
        if self.expert_mesh is not None:
            raise NotImplementedError(
                f"Plan(pp={self.plan.pp}, ep={self.plan.ep}): the optimizer state is not gathered whole; "
                "save it with tessera.train.sharded_checkpoint.save_sharded (it loads under any plan)"
            )
        from tessera.train.export import gpt2_tensor_layout
        from tessera.train.full_optim_state import HYPER_SKIP

        axes = [a for a in ("pp", "dp", "sp") if a in self.mesh.axes]
        params = dict(self.model.named_parameters())
        names = [n for group in self.group_names for n in group]
        stepped = {id(p) for g in self.inner.param_groups for p in g["params"] if self.inner.state.get(p)}
        kinds = self._agreed_kinds(axes)
        # one writer per parameter: the highest (pp, dp, sp) position that steps it (tp ranks
        # of that position gather a tp-sharded state together)
        me = 0
        for a in axes:
            me = me * self.mesh.size(a) + self.mesh.rank(a)
        writer = torch.tensor(
            [me if id(params[n]) in stepped else -1 for n in names],
            dtype=torch.int64,
            device=self.mesh.device,
        )
        for a in axes:
            self.mesh.comm.all_reduce(writer, a, op="max")
        wholes: list[tuple[int, str, str, torch.Tensor]] = []  # (index, name, kind, tensor)
        for index, (name, w) in enumerate(zip(names, writer.tolist(), strict=True)):
            if w < 0:  # not stepped yet anywhere (torch leaves it out too)
                continue
            p = params[name]
            own = self.inner.state.get(p, {}) if w == me else {}
            shape = self.param_shapes.get(name, list(p.shape))
            for kind, per_element in kinds:
                if per_element:
                    value = own.get(kind)
                    whole = (
                        _full(value).detach().clone()
                        if value is not None
                        else torch.zeros(shape, dtype=p.dtype, device=self.mesh.device)
                    )
                else:  # a scalar (Adam's step): as float64 for the sum
                    whole = torch.tensor(
                        [float(own[kind]) if kind in own else 0.0],
                        dtype=torch.float64,
                        device=self.mesh.device,
                    )
                wholes.append((index, name, kind, whole))
        # the sums: one flat all-reduce per dtype and axis, not one per tensor
        for dtype in sorted({t.dtype for *_, t in wholes}, key=str):  # one order on every rank
            same = [t for *_, t in wholes if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in same])
            for a in axes:
                self.mesh.comm.all_reduce(flat, a)
            for t, total in zip(same, flat.split([t.numel() for t in same]), strict=True):
                t.copy_(total.view_as(t))
        degree = getattr(self.model, "_tessera_gpt2_tp_degree", None)
        state: dict = {}
        for index, name, kind, whole in wholes:
            if not dict(kinds)[kind]:  # a scalar: a float32 tensor, as torch keeps it
                value = torch.tensor(float(whole), dtype=torch.float32)
            else:
                value = whole if degree is None else gpt2_tensor_layout(name, whole, degree, to_hf=True)
            state.setdefault(index, {})[kind] = value
        groups, index = [], 0
        for group, group_names in zip(self.inner.param_groups, self.group_names, strict=True):
            hyper = {k: v for k, v in group.items() if k not in HYPER_SKIP}
            groups.append({**hyper, "params": list(range(index, index + len(group_names)))})
            index += len(group_names)
        return {"state": state, "param_groups": groups}

    def _agreed_kinds(self, axes: list[str]) -> list[tuple[str, bool]]:
        """The optimizer's state keys, each (name, per-element?), the same on every rank: a
        rank stepping nothing yet (ZeRO-1, a small stage) learns them from the others."""
        local = sorted(
            {
                (k, isinstance(v, torch.Tensor) and v.dim() > 0)
                for p, st in self.inner.state.items()
                for k, v in st.items()
                if isinstance(v, (torch.Tensor, float, int))
            }
        )
        text = ";".join(f"{k}:{int(e)}" for k, e in local).encode()
        size = torch.tensor([len(text)], dtype=torch.int64, device=self.mesh.device)
        for a in axes:
            self.mesh.comm.all_reduce(size, a, op="max")
        codes = torch.zeros(int(size), dtype=torch.int64, device=self.mesh.device)
        if text:
            codes[: len(text)] = torch.tensor(list(text), dtype=torch.int64)
        for a in axes:  # ranks that step anything hold the same keys; the others hold zeros
            self.mesh.comm.all_reduce(codes, a, op="max")
        agreed = bytes(codes.tolist()).decode()
        return [(k, e == "1") for k, e in (item.split(":") for item in agreed.split(";") if item)]

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (``state_dict()`` under any plan, or a plain torch optimizer's)
        into this rank's stages: each rank keeps the parameters it steps (at ZeRO-1 its share,
        a tp shard its piece)."""
        from tessera.train.full_optim_state import load_optimizer_state_dict

        names = [n for group in self.group_names for n in group]
        held = {id(p) for p in self.engine.owner}
        params = dict(self.model.named_parameters())
        mine = {
            index: entry
            for index, entry in state_dict["state"].items()
            if id(params[names[int(index)]]) in held
        }
        load_optimizer_state_dict(self, {**state_dict, "state": mine})

    def _sum_over_sp(self) -> None:
        grads = [local_tensor(p.grad) for p in self.trainer.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.mesh.comm.all_reduce(flat, "sp")
        for g, total in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(total.view_as(g))

    def _share_updates(self) -> None:
        """ZeRO-1: every parameter from the dp rank that stepped it, one flat broadcast per
        owner rank (not one per parameter)."""
        with torch.no_grad():
            for rank in range(self.mesh.size("dp")):
                mine = [
                    local_tensor(p.data) for p in self.trainer.parameters() if self.owner_rank.get(id(p)) == rank
                ]
                if not mine:
                    continue
                flat = torch.cat([t.reshape(-1) for t in mine])
                self.mesh.comm.broadcast(flat, "dp", src=rank)
                for t, new in zip(mine, flat.split([t.numel() for t in mine]), strict=True):
                    t.copy_(new.view_as(t))

    @property
    def stepped_parameters(self) -> list:
        """The parameters of this rank's stages (at ZeRO-1 the optimizer steps a share)."""
        return self.trainer.parameters()

    def _clip(self) -> float | None:
        """The global gradient norm over every stage (a tied weight once), and the clip."""
        if self.plan.max_grad_norm is None:
            return None
        grads = self._counted_grads()
        squares = self._squares([g for i, g in grads.items() if i not in self.expert_ids])
        if self.expert_mesh is not None:  # each expert once: the ep ranks hold different ones
            experts = torch.zeros(1, dtype=torch.float64, device=self.mesh.device)
            for i in self.expert_ids & grads.keys():
                experts += local_tensor(grads[i]).double().pow(2).sum()
            self.expert_mesh.comm.all_reduce(experts, "ep")
            squares += experts
        self.mesh.comm.all_reduce(squares, "pp")
        norm = float(squares.sqrt())
        coef = clip_coefficient(norm, self.plan.max_grad_norm)
        if coef is not None:
            for g in {
                id(p.grad): p.grad for m in self.trainer.modules for p in m.parameters() if p.grad is not None
            }.values():
                g.mul_(coef)
        return norm

    def _squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """This stage's summed squared gradients: a tp shard's local squares, summed over tp in
        one all-reduce (not a gather of each DTensor gradient whole), plus each replicated
        tensor once (every tp rank holds the same copy)."""
        sharded = torch.zeros(1, dtype=torch.float64, device=self.mesh.device)
        whole = torch.zeros(1, dtype=torch.float64, device=self.mesh.device)
        for g in grads:
            placements = getattr(g, "placements", ())
            if any(pl.is_partial() for pl in placements):  # a pending sum: only the whole is right
                whole += g.full_tensor().double().pow(2).sum()
            elif any(pl.is_shard() for pl in placements):
                sharded += g.to_local().double().pow(2).sum()
            else:
                whole += local_tensor(g).double().pow(2).sum()
        if "tp" in self.mesh.axes and self.mesh.size("tp") > 1:
            self.mesh.comm.all_reduce(sharded, "tp")
        return sharded + whole

    def _counted_grads(self) -> dict[int, torch.Tensor]:
        """Each parameter's gradient once over the pipeline: the tied head on the last stage
        is the embedding the first stage counts."""
        tied_head = None
        if self.trainer.tied:
            for m in self.trainer.modules:
                if m.last and not m.first:
                    tied_head = id(m.head.weight)
        seen = {}
        for p in self.trainer.parameters():
            if p.grad is not None and id(p) != tied_head:
                seen[id(p)] = p.grad
        return seen


def _release(model: nn.Module, kept: set[int]) -> None:
    """Other stages' parameters become empty tensors: this rank no longer holds them."""
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in kept and not hasattr(p, "to_local"):  # a tp shard (DTensor) stays
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _partition(params: list, ranks: int) -> dict[int, int]:
    """id(parameter) -> the dp rank that steps it: the largest first, each to the rank with
    the fewest elements so far (the same on every rank: same parameters, same order)."""
    load, owner = [0] * ranks, {}
    for p in sorted(params, key=lambda p: -p.numel()):
        r = min(range(ranks), key=lambda i: load[i])
        owner[id(p)] = r
        load[r] += p.numel()
    return owner
