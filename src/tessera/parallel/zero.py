"""Data parallelism and ZeRO 1/2/3 as settings of one core: parameters grouped into flat
chunks (``tessera.memory.chunk``), each chunk split into equal shards over the ``dp`` axis.

One chunk is the unit of every collective: after backward, a chunk's gradients are copied
into one flat buffer as soon as the last of its parameters has its gradient, and reduced in
one call. What the stage changes:

========  =============================  ==========================  =====================
stage     gradients after backward       optimizer state             parameters at rest
========  =============================  ==========================  =====================
0         all-reduced, left in p.grad    user's optimizer, full      full
1         all-reduced, left in p.grad    this rank's shard only      full (all-gathered)
2         reduce-scattered, p.grad freed this rank's shard only      full (all-gathered)
3         reduce-scattered, p.grad freed this rank's shard only      this rank's shard only
========  =============================  ==========================  =====================

At stages 1-3 the optimizer runs on one flat fp32 shard per chunk (a Parameter whose
``.grad`` is that shard of the averaged gradient), so its states are 1/dp of the model's.
Stage 3 keeps only that shard between uses: a chunk's parameters are views of one full
buffer whose storage is emptied after use and refilled by an all-gather before a module's
forward, and again before its backward (autograd's saved views see the refilled storage).

Tensor parallel parameters (DTensors) take part through their local shards; a chunk holds
parameters of one optimizer group and one kind (sharded over ``tp`` or replicated on it), so
the global gradient norm counts each replicated element once.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from tessera.memory.chunk import pack
from tessera.runtime import Mesh


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tp_sharded(p: torch.Tensor) -> bool:
    placements = getattr(p, "placements", ())
    return any(pl.is_shard() for pl in placements)


class ChunkGroup:
    """The parameters of one chunk: their slots, the shard this rank owns, and (stage 3) the
    full buffer their data lives in."""

    def __init__(
        self, chunk, params: list[nn.Parameter], group_index: int, tp_sharded: bool, mesh: Mesh, axis
    ):
        self.chunk, self.params, self.group_index, self.tp_sharded = chunk, params, group_index, tp_sharded
        self.mesh, self.axis = mesh, axis
        self.dp = mesh.size(axis)
        self.rank = mesh.rank(axis)
        self.pending = len(params)
        self.reduced = False
        self.full = True

    @property
    def shard_size(self) -> int:
        return self.chunk.capacity // self.dp

    def flat_grads(self) -> torch.Tensor:
        flat = torch.zeros(self.chunk.capacity, dtype=torch.float32, device=self.chunk.buffer.device)
        for slot, p in zip(self.chunk.slots, self.params, strict=True):
            if p.grad is not None and hasattr(p, "placements") and p.grad.placements != p.placements:
                # a tied parameter used by differently sharded modules can get its gradient
                # in another layout: bring it to the parameter's own
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            if p.grad is not None:
                flat[slot.offset : slot.offset + slot.numel].copy_(_local(p.grad).reshape(-1))
        return flat

    def write_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for slot, p in zip(self.chunk.slots, self.params, strict=True):
                _local(p.data).copy_(flat[slot.offset : slot.offset + slot.numel].view_as(_local(p.data)))

    # stage 3: the chunk's buffer is the parameters' storage
    def bind(self) -> None:
        for slot, p in zip(self.chunk.slots, self.params, strict=True):
            p.data = self.chunk.view(slot)

    def release(self) -> None:
        if self.full:
            self.chunk.buffer.untyped_storage().resize_(0)
            self.full = False

    def gather(self, shard: torch.Tensor, comm) -> None:
        if self.full:
            return
        buffer = self.chunk.buffer
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffer):
            comm.all_gather_into(buffer, shard, self.axis)
        self.full = True


class ZeroEngine:
    """Installs the gradient hooks (and stage 3's gather/release hooks) on ``model`` and
    provides the optimizer step. Built by ``tessera.boost``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        zero: int,
        mesh: Mesh,
        axis: str = "dp",
        chunk_elems: int = 8 << 20,
        max_grad_norm: float | None = None,
        tp_axis: str | None = None,
    ):
        if zero == 3 and tp_axis is not None and mesh.size(tp_axis) > 1:
            raise ValueError("zero=3 with tp > 1 is not supported yet; use zero <= 2 with tensor parallel")
        self.model, self.user_optimizer, self.zero, self.mesh, self.axis = model, optimizer, zero, mesh, axis
        self.tp_axis = tp_axis if tp_axis is not None and mesh.size(tp_axis) > 1 else None
        self.max_grad_norm = max_grad_norm
        self.comm = mesh.comm
        self.sync = True
        self.groups: list[ChunkGroup] = []
        self.owner: dict[nn.Parameter, ChunkGroup] = {}
        dp = mesh.size(axis)
        for gi, group in enumerate(optimizer.param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            for kind in (True, False):
                chosen = [p for p in params if _tp_sharded(p) == kind]
                if not chosen:
                    continue
                named = [(str(i), _local(p.detach()).float()) for i, p in enumerate(chosen)]
                for chunk in pack(named, chunk_elems=chunk_elems, align=dp, device=_local(chosen[0]).device):
                    members = [chosen[int(slot.name)] for slot in chunk.slots]
                    cg = ChunkGroup(chunk, members, gi, kind, mesh, axis)
                    self.groups.append(cg)
                    for p in members:
                        self.owner[p] = cg
        self.shards: list[nn.Parameter] = []
        if zero >= 1:
            for cg in self.groups:
                shard = nn.Parameter(cg.chunk.shard(cg.rank, dp).clone())
                self.shards.append(shard)
            inner_groups = []
            for gi, group in enumerate(optimizer.param_groups):
                mine = [s for s, cg in zip(self.shards, self.groups, strict=True) if cg.group_index == gi]
                if mine:
                    inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mine})
            self.optimizer = type(optimizer)(inner_groups)  # every group carries all its settings
        else:
            self.optimizer = optimizer
        if zero == 3:
            for cg in self.groups:
                cg.bind()
                cg.release()
            self._install_stage3_hooks()
        else:
            for cg in self.groups:
                cg.release()  # the packed copy is not needed: parameters keep their own storage
        for p in self.owner:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    # ---- gradients -------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally (earlier micro-batches)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        cg = self.owner[p]
        cg.pending -= 1
        if cg.pending == 0:
            self._reduce(cg)

    def _reduce(self, cg: ChunkGroup) -> None:
        flat = cg.flat_grads()
        if self.zero <= 1:
            self.comm.all_reduce(flat, self.axis, op="avg")
            for slot, p in zip(cg.chunk.slots, cg.params, strict=True):
                if p.grad is not None:
                    _local(p.grad).copy_(flat[slot.offset : slot.offset + slot.numel].view_as(_local(p.grad)))
            cg.grad_shard = flat[cg.rank * cg.shard_size : (cg.rank + 1) * cg.shard_size].clone()
        else:
            shard = torch.empty(cg.shard_size, dtype=flat.dtype, device=flat.device)
            self.comm.reduce_scatter_into(shard, flat, self.axis)
            cg.grad_shard = shard.div_(cg.dp)
            for p in cg.params:
                p.grad = None
            if self.zero == 3:
                cg.release()
        cg.reduced = True

    def finish_backward(self) -> None:
        """Reduce chunks some of whose parameters got no gradient this step (unused ones)."""
        for cg in self.groups:
            if not cg.reduced:
                self._reduce(cg)

    # ---- optimizer -------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm over every parameter once (after reduction)."""
        total = torch.zeros((), dtype=torch.float64)
        for cg in self.groups:
            if self.zero == 0:
                part = sum(
                    (_local(p.grad).double().pow(2).sum() for p in cg.params if p.grad is not None),
                    torch.zeros((), dtype=torch.float64),
                )
            else:
                part = cg.grad_shard.double().pow(2).sum()
            if self.tp_axis is not None and not cg.tp_sharded:
                part = part / self.mesh.size(self.tp_axis)  # every tp rank holds the same copy
            total += part
        if self.zero >= 1:
            self.comm.all_reduce(total, self.axis)
        if self.tp_axis is not None:
            self.comm.all_reduce(total, self.tp_axis)
        return total.sqrt()

    def step(self) -> float | None:
        self.finish_backward()
        norm = None
        if self.max_grad_norm is not None:
            norm = float(self.grad_norm())
            scale = self.max_grad_norm / (norm + 1e-6)
            if scale < 1:
                for cg in self.groups:
                    if self.zero == 0:
                        for p in cg.params:
                            if p.grad is not None:
                                p.grad.mul_(scale)
                    else:
                        cg.grad_shard.mul_(scale)
        if self.zero >= 1:
            for cg, shard in zip(self.groups, self.shards, strict=True):
                shard.grad = cg.grad_shard
        self.optimizer.step()
        if self.zero in (1, 2):
            for cg, shard in zip(self.groups, self.shards, strict=True):
                full = torch.empty(cg.chunk.capacity, dtype=shard.dtype, device=shard.device)
                self.comm.all_gather_into(full, shard.detach(), self.axis)
                cg.write_params(full)
        for cg in self.groups:
            cg.pending, cg.reduced = len(cg.params), False
            cg.grad_shard = None
        return norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.owner:
            p.grad = None

    # ---- loading (tessera.train.sharded_checkpoint) -----------------------------------------
    def load_local(self, p: nn.Parameter, kind: str, local: torch.Tensor, scalars: dict) -> None:
        """Set this rank's piece of parameter ``p`` (``kind`` "param") or of one of its
        per-element optimizer states from ``local`` (p's whole local tensor)."""
        cg = self.owner[p]
        slot = cg.chunk.slots[next(i for i, q in enumerate(cg.params) if q is p)]
        with torch.no_grad():
            if kind == "param" and self.zero < 3:
                _local(p.data).copy_(local)
            if self.zero == 0:
                if kind != "param":
                    value = local.clone()
                    if hasattr(p, "placements"):
                        from torch.distributed.tensor import DTensor

                        value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False)
                    state = self.optimizer.state[p]
                    state[kind] = value
                    state.update({k: torch.tensor(v) for k, v in scalars.items()})
                return
            shard = self.shards[self.groups.index(cg)]
            lo = cg.rank * cg.shard_size
            a, b = max(lo, slot.offset), min(lo + cg.shard_size, slot.offset + slot.numel)
            if a >= b:
                return
            piece = local.reshape(-1)[a - slot.offset : b - slot.offset]
            if kind == "param":
                shard.data[a - lo : b - lo] = piece
            else:
                state = self.optimizer.state[shard]
                if kind not in state:
                    state[kind] = torch.zeros_like(shard.data)
                state[kind][a - lo : b - lo] = piece
                state.update({k: torch.tensor(v) for k, v in scalars.items()})

    # ---- stage 3 ---------------------------------------------------------------------------
    def _install_stage3_hooks(self) -> None:
        """Gather a chunk before the first module that uses it runs forward, free it after
        the last one (in the order recorded on the first forward; until then after each
        module), gather it again when backward reaches a module using it, and free it once
        its gradients are reduced."""
        by_module: dict[nn.Module, list[ChunkGroup]] = {}
        for module in self.model.modules():
            mine = {self.owner[p] for p in module.parameters(recurse=False) if p in self.owner}
            if mine:
                by_module[module] = sorted(mine, key=self.groups.index)
        shard_of = dict(zip(self.groups, self.shards, strict=True))
        order: list[nn.Module] = []
        last_user: dict[ChunkGroup, nn.Module] = {}

        def gather(groups):
            for cg in groups:
                cg.gather(shard_of[cg].detach(), self.comm)

        def pre_forward(module, args):
            if not last_user:
                order.append(module)
            gather(by_module[module])

        def post_forward(module, args, output):
            groups = by_module[module]
            if torch.is_grad_enabled():
                tensors = [
                    t
                    for t in torch.utils._pytree.tree_leaves(output)
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads: gather(groups), mode="any"
                    )
            for cg in groups:
                if last_user.get(cg, module) is module:
                    cg.release()

        def end_of_forward(module, args, output):
            if not last_user and order:
                for m in order:
                    for cg in by_module[m]:
                        last_user[cg] = m

        for module in by_module:
            module.register_forward_pre_hook(pre_forward)
            module.register_forward_hook(post_forward)
        self.model.register_forward_hook(end_of_forward)

    def gather_all(self) -> None:
        """Stage 3: make every parameter whole (for evaluation or saving)."""
        for cg, shard in zip(self.groups, self.shards, strict=True):
            cg.gather(shard.detach(), self.comm)


def chunk_elems_for(mib: float) -> int:
    return max(1, math.ceil(mib * 2**20 / 4))
