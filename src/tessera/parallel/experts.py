"""Expert parallelism for transformers mixture-of-experts models, applied from outside.

What comes from transformers (5.24), unchanged:

- the plan: ``config.base_model_ep_plan`` as the model class resolves it (``model.ep_plan``,
  e.g. Mixtral's ``model.layers.*.mlp.experts.gate_up_proj: grouped_gemm`` and
  ``model.layers.*.mlp.experts: ep_dispatch_experts``), its ``*`` matched here against the
  model's module names as Tessera's tensor parallel plans are;
- the sharding of the expert weights: the ``grouped_gemm`` style (``MoEParamShard``) makes
  each weight a DTensor sharded on the expert dimension over the ``ep`` ranks and sets the
  experts module's ``num_experts`` to its local count;
- the router (the model's own gate) and the experts' own forward (``grouped_mm``, ``eager``,
  whatever ``config._experts_implementation`` says), run on local expert ids, and the
  ``EPImplementation`` interface and algorithm of ``AllToAllEP``: (token, expert) pairs
  sorted by expert, exchanged with all-to-all, run by the local experts with unit weights,
  sent back and combined with the router's weights on the sender.

What Tessera writes (``ExpertDispatch``, an ``AllToAllEP``): both exchanges, and the one of
the per-expert counts, go through ``tessera.runtime.comm`` (variable split sizes,
differentiable), so their bytes are counted per step under ``all_to_all@ep``; an optional
capacity factor; counts of the tokens each expert got and of the dropped ones. The hook is
installed as transformers' ``ep_dispatch_experts`` style installs its own (the experts
module's ``forward`` replaced, its DTensor weights used as local tensors meanwhile), but with
this implementation instance, which holds the Mesh's counted ``Comm``.

Composition. With ``tp`` the attention, the embedding and the head keep the model's own tensor
parallel plan (``attention_plan`` drops the entries inside MoE blocks; the router and a
shared expert run replicated on every tp rank); the ep groups are the ranks of one tp
coordinate and, as ``AllToAllEP`` does, each tp rank dispatches a contiguous slice of the
tokens its tp group shares (``_TakeRows``: its gradient gathered in backward) and the slices'
outputs are all-gathered (``_GatherRows``), both through ``Comm`` over ``tp``. The expert work
and the exchanged bytes are so divided by tp; an expert's local gradient is then a partial
sum over tp, which ZeRO all-reduces over tp before its reduction over edp. With ``pp`` each stage's MoE layers are split over
the ep ranks of that stage (the expert mesh is pp x edp x ep x tp); micro-batches are
exchanged one by one as the schedule runs them, every dp replica of a stage in the same
order. Under activation checkpointing a block's recomputation exchanges its tokens again
(counted in bytes, not in ``tokens_per_expert``; ``recomputation``). bf16 autocast leaves the
exchanged tensors fp32 on CPU (the residual stream is fp32 and the experts' ``grouped_mm``
output was measured fp32).

Bytes per MoE layer per training step on one rank (``Comm``'s convention: an all-to-all
counts this rank's input): ``8 E`` for the counts, then ``(S + R) H b`` forward (dispatch,
combine) and the same backward, where ``S`` is the pairs this rank sends (its tokens x top-k,
less the dropped), ``R`` the pairs its experts receive, ``H`` the hidden width and ``b`` the
bytes of an element: ``8 E + 2 (S + R) H b`` (``a2a_bytes``); with activation checkpointing
``16 E + 3 (S + R) H b``.

Capacity (GShard's per-group capacity, the group being this rank's tokens of the layer, its tp slice under tp):
each expert takes at most ``ceil(capacity_factor x pairs / experts)`` of this rank's pairs,
the first in token order; the others are dropped (their expert output is zero, so the
token keeps its residual and whatever its other experts give) and counted.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from transformers.distributed.expert_parallel import (
    AllToAllEP,
    EpDispatchExpertsParallel,
    _AllToAllState,
)
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

from tessera.parallel.expert_costs import a2a_bytes  # noqa: F401  (the formula, torch-free)
from tessera.parallel.tp_plans import path_matches as _matches
from tessera.runtime import Mesh

# The routers whose output Tessera's dispatch was checked against (the parity tests):
# softmax top-k, global expert ids, weights the experts multiply by. Others (DeepSeek's grouped
# routing with a load-balancing bias, gpt-oss's biased router, ...) are refused by name.
KNOWN_ROUTERS = {
    "mixtral": "MixtralTopKRouter",
    "qwen2_moe": "Qwen2MoeTopKRouter",
    "qwen3_moe": "Qwen3MoeTopKRouter",
}
PARAM_STYLE, MODULE_STYLE = "grouped_gemm", "ep_dispatch_experts"


def ep_plan_of(model: nn.Module, ep: int) -> dict[str, str]:
    """The model's expert parallel plan, one entry per parameter and module (checked: a MoE
    family whose router Tessera knows, every pattern matching, ``ep`` dividing the experts)."""
    config = getattr(model, "config", None)
    plan = dict(getattr(model, "ep_plan", None) or {})
    if config is None or not plan:
        raise ValueError(
            f"Plan(ep={ep}) splits the experts of mixture-of-experts layers, but {type(model).__name__} "
            "ships no expert parallel plan (config.base_model_ep_plan): it is a dense model; use ep=1"
        )
    if config.model_type not in KNOWN_ROUTERS:
        raise ValueError(
            f"Plan(ep={ep}): Tessera does not know the router of model type {config.model_type!r} "
            f"(known: {', '.join(KNOWN_ROUTERS)}); use ep=1"
        )
    resolved = _expand(model, plan)
    for name, style in resolved.items():
        if style == MODULE_STYLE:
            experts = model.get_submodule(name).num_experts
            if experts % ep:
                raise ValueError(
                    f"Plan(ep={ep}) does not divide the {experts} experts of {name}; use an ep that divides {experts}"
                )
    return resolved


def _expand(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Pattern -> style, as concrete parameter and module names (each module's parameters first)."""
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in (PARAM_STYLE, MODULE_STYLE):
            raise ValueError(
                f"expert parallel plan entry {pattern!r}: style {style!r} is not supported "
                f"(Tessera runs {PARAM_STYLE!r} and {MODULE_STYLE!r})"
            )
        names = params if style == PARAM_STYLE else modules
        hits = [n for n in names if _matches(pattern, n)]
        if not hits:
            kind = "parameter" if style == PARAM_STYLE else "module"
            raise ValueError(
                f"expert parallel plan entry {pattern!r} matches no {kind} of {type(model).__name__}"
            )
        out |= dict.fromkeys(hits, style)
    for name in out:
        if out[name] == PARAM_STYLE and out.get(name.rpartition(".")[0]) != MODULE_STYLE:
            raise ValueError(
                f"expert weight {name} is sharded but its module is not dispatched ({MODULE_STYLE})"
            )
    return dict(sorted(out.items(), key=lambda item: (item[1] != PARAM_STYLE, item[0])))


def apply_experts(
    model: nn.Module, plan: dict[str, str], expert_mesh: Mesh, *, capacity_factor: float | None = None
) -> set[nn.Parameter]:
    """Shard ``model``'s experts over the ``ep`` axis of ``expert_mesh`` (axes edp, ep, tp) by
    ``plan`` (``ep_plan_of``), in place; every rank must hold the same whole model. Returns the
    expert parameters (DTensors over ``ep``)."""
    ep_mesh, tp_mesh = expert_mesh.device_mesh["ep"], expert_mesh.device_mesh["tp"]
    shard = ALL_PARALLEL_STYLES[PARAM_STYLE]  # transformers' MoEParamShard(Shard(0))
    experts: set[nn.Parameter] = set()
    for name, style in plan.items():
        owner, _, attr = name.rpartition(".")
        if style == PARAM_STYLE:
            module = model.get_submodule(owner)
            shard.shard_param(module, attr, ep_mesh)
            experts.add(getattr(module, attr))
        else:
            module = model.get_submodule(name)
            dispatch = ExpertDispatch(
                module, ep_mesh, tp_mesh, comm=expert_mesh.comm, capacity_factor=capacity_factor
            )
            _install(module, dispatch, ep_mesh)
    return experts


def _install(module: nn.Module, dispatch: ExpertDispatch, ep_mesh) -> None:
    """As transformers' ``EpDispatchExpertsParallel.install_forward``, with our instance."""
    style = EpDispatchExpertsParallel()

    def ep_forward(hidden_states, top_k_index, top_k_weights):
        with style.context_around_forward(module, ep_mesh):  # DTensor weights as local tensors
            output = dispatch(hidden_states, top_k_index, top_k_weights)
        return output.to(hidden_states.dtype)

    module.forward = ep_forward
    module._tessera_dispatch = dispatch


def dispatches(model: nn.Module) -> list[ExpertDispatch]:
    """The expert dispatch of every MoE layer of a boosted model, in module order."""
    return [m._tessera_dispatch for m in model.modules() if hasattr(m, "_tessera_dispatch")]


@contextlib.contextmanager
def recomputation(model: nn.Module):
    """Activation checkpointing's recomputation of a block: its dispatches exchange the tokens
    again (the ledger counts those bytes) but do not count the tokens and drops twice."""
    found = dispatches(model)
    for d in found:
        d.counting = False
    try:
        yield
    finally:
        for d in found:
            d.counting = True


class ExpertDispatch(AllToAllEP):
    """``AllToAllEP`` through Tessera's counted ``Comm`` (axis ``ep``), with an optional
    capacity factor. ``tokens_per_expert`` (global expert ids) counts the pairs this rank
    sent each expert and ``dropped`` the pairs over capacity, since the last ``reset_counts``."""

    def __init__(self, experts: nn.Module, ep_mesh, tp_mesh, *, comm, capacity_factor: float | None):
        super().__init__(experts, ep_mesh, tp_mesh)
        self.comm, self.capacity_factor = comm, capacity_factor
        self.tp = tp_mesh.size()  # the tp ranks share a batch: each dispatches its slice of it
        self.counting = True  # off while activation checkpointing recomputes a block
        self.ep = ep_mesh.size()
        self.num_experts = self.num_local_experts * self.ep
        self.reset_counts()

    def reset_counts(self) -> None:
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long)
        self.dropped = 0
        self.pairs_sent = self.pairs_received = 0

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        if self.tp == 1:
            return super().__call__(hidden_states, top_k_index, top_k_weights)
        # as AllToAllEP under tp: each tp rank takes its slice of the rows (its gradient is
        # gathered in backward, so every tp rank gets the whole input gradient, as the rest of
        # the replicated block computes it), and the slices' outputs are gathered
        sizes = _row_sizes(hidden_states.size(0), self.tp)
        me = self.comm.mesh.rank("tp")
        lo, hi = sum(sizes[:me]), sum(sizes[: me + 1])
        mine = [_TakeRows.apply(t, self.comm, lo, hi, sizes) for t in (hidden_states, top_k_weights)]
        output = super().__call__(mine[0], top_k_index[lo:hi], mine[1])
        return _GatherRows.apply(output, self.comm, lo, hi, sizes)

    def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
        num_tokens, top_k = hidden_states.size(0), top_k_index.size(-1)
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)  # by expert, token order within one
        counts = torch.bincount(expert_ids, minlength=self.num_experts)
        if self.capacity_factor is not None:
            order, counts = self._capped(order, expert_ids[order], counts)
        send_counts = counts.view(self.ep, self.num_local_experts)
        recv_counts = self.comm.all_to_all(send_counts, "ep", scatter_dim=0, gather_dim=0)
        send_sizes, recv_sizes = send_counts.sum(dim=1).tolist(), recv_counts.sum(dim=1).tolist()
        recv_tokens = self.comm.all_to_all_split(hidden_states[order // top_k], "ep", send_sizes, recv_sizes)
        local_ids = torch.arange(self.num_local_experts, device=hidden_states.device).repeat(self.ep)
        recv_ids = local_ids.repeat_interleave(recv_counts.reshape(-1)).unsqueeze(-1)
        # the experts run top-1 with unit weights; the router's are applied on the sender
        recv_weights = torch.ones_like(recv_ids, dtype=recv_tokens.dtype)
        if self.counting:
            self.tokens_per_expert += counts.cpu()
            self.pairs_sent += sum(send_sizes)
            self.pairs_received += sum(recv_sizes)
        return (
            recv_tokens,
            recv_ids,
            recv_weights,
            _AllToAllState(top_k_weights, order, send_sizes, recv_sizes, num_tokens),
        )

    def _capped(self, order, sorted_ids, counts):
        """The first ``capacity`` pairs of each expert (in token order) and their counts."""
        capacity = math.ceil(self.capacity_factor * sorted_ids.numel() / self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(sorted_ids.numel(), device=sorted_ids.device) - starts[sorted_ids]
        keep = position < capacity
        if self.counting:
            self.dropped += int((~keep).sum())
        return order[keep], counts.clamp(max=capacity)

    def _combine_tokens(self, expert_output, state):
        hidden_dim = expert_output.size(-1)
        back = self.comm.all_to_all_split(expert_output, "ep", state.recv_sizes, state.send_sizes)
        # dropped pairs keep zeros: their weight multiplies nothing
        pairs = back.new_zeros(state.top_k_weights.numel(), hidden_dim).index_copy(0, state.order, back)
        pairs = pairs.view(*state.top_k_weights.shape, hidden_dim)
        return (pairs * state.top_k_weights.unsqueeze(-1)).sum(dim=1)


def _row_sizes(rows: int, parts: int) -> list[int]:
    """``rows`` split into ``parts`` contiguous slices, the first ``rows % parts`` one longer."""
    base, extra = divmod(rows, parts)
    return [base + (i < extra) for i in range(parts)]


def _gather_rows(t: torch.Tensor, comm, sizes: list[int]) -> torch.Tensor:
    """Every tp rank's slice of rows (``sizes``), in order: one all-gather of slices padded
    to the longest."""
    width = max(sizes)
    padded = t.new_zeros((width, *t.shape[1:]))
    padded[: t.shape[0]] = t
    whole = comm.all_gather(padded, "tp", dim=0)
    return torch.cat([whole[i * width : i * width + n] for i, n in enumerate(sizes)])


class _TakeRows(torch.autograd.Function):
    """Forward: this tp rank's rows of a tensor every tp rank holds whole. Backward: the slices'
    gradients gathered, so each rank has the whole gradient (a replicated tensor's)."""

    @staticmethod
    def forward(ctx, t, comm, lo: int, hi: int, sizes: list[int]):
        ctx.comm, ctx.sizes = comm, sizes
        return t[lo:hi].clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad.contiguous(), ctx.comm, ctx.sizes), None, None, None, None


class _GatherRows(torch.autograd.Function):
    """Forward: the tp ranks' row slices gathered whole. Backward: this rank's rows of the
    gradient (every tp rank holds the same whole gradient of a replicated tensor)."""

    @staticmethod
    def forward(ctx, t, comm, lo: int, hi: int, sizes: list[int]):
        ctx.lo, ctx.hi = lo, hi
        return _gather_rows(t.contiguous(), comm, sizes)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.lo : ctx.hi].contiguous(), None, None, None, None


def attention_plan(tp_plan, model: nn.Module, ep_plan: dict[str, str]):
    """``tp_plan`` (a ``tessera.parallel.tp_plans.TPPlan``) less every entry inside a MoE block
    (the module holding a dispatched experts module: its experts, router and shared expert):
    under ``Plan(ep, tp)`` those blocks belong to ep (each tp rank dispatching its slice of the
    tokens, the router and a shared expert replicated); the
    attention, embedding and head keep the model's own tensor parallel styles."""
    from dataclasses import replace

    blocks = {name.rpartition(".")[0] for name, style in ep_plan.items() if style == MODULE_STYLE}
    modules = dict(model.named_modules())

    def inside(pattern: str) -> bool:
        hits = [n for n in modules if _matches(pattern, n)] or [
            n for n, _ in model.named_parameters() if _matches(pattern, n)
        ]
        if not hits:  # e.g. a dense-MLP entry of a family whose layers here are all MoE
            parent = pattern.rpartition(".")[0]
            return any(_matches(parent, b) for b in blocks)
        return all(any(n == b or n.startswith(b + ".") for b in blocks) for n in hits)

    return replace(tp_plan, layers={k: v for k, v in tp_plan.layers.items() if not inside(k)})


def expert_mesh_for(mesh: Mesh, ep: int) -> Mesh:
    """The expert mesh over the ranks of ``mesh`` (axes [pp,] dp, tp): each dp row of ``ep``
    consecutive ranks an ``ep`` group, the ranks holding the same experts along ``edp`` (one
    pipeline stage's). Its collectives are counted in ``mesh``'s ledger."""
    dp, tp = mesh.size("dp"), mesh.size("tp") if "tp" in mesh.axes else 1
    pp = {"pp": mesh.size("pp")} if "pp" in mesh.axes else {}
    experts = Mesh(**pp, edp=dp // ep, ep=ep, tp=tp)
    experts.comm.ledger = mesh.comm.ledger
    return experts
