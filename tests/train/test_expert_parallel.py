"""Expert parallelism (``Plan(ep=E)``, ``tessera.parallel.experts``) against one process:
tiny Mixtral, Qwen2-MoE and Qwen3-MoE (8 experts, top-2) take the same SGD and AdamW steps
from the same weights on the same global batches; losses, gradients (the reduced ones where
the plan keeps them whole, else the global norm), and parameters after 3 steps are compared.
On 2 ranks: ep2 at ZeRO 0-3, with clipping, an uneven routing (a rank receives no token in
one layer, an expert none in the other), a capacity factor, the load-balancing loss; on 4
ranks: ep2 x dp2 at ZeRO-1 and ZeRO-3, ep4. Composed with the other plans: bf16 autocast and
activation checkpointing (ZeRO-0 and ZeRO-3 with clipping) on 2 ranks (bf16: ZeRO-1 AdamW and
ZeRO-3 SGD); ep2 x tp2 (the
attention tensor-parallel by transformers' own plan, ZeRO-1 AdamW and ZeRO-3 with clipping)
and ep2 x pp2 (one MoE layer per stage; ZeRO-0 SGD, and ZeRO-1 AdamW with clipping and
activation checkpointing) on 4. Each group of cases runs in one spawned group.
The all-to-all bytes each rank counts per step equal ``a2a_bytes`` of the routing recorded
at the routers, exactly (with activation checkpointing, the recomputed forward exchanges too).

The reference is one process. Cross-entropy over equal shards averages to the whole batch's,
so it trains on the whole batch; the load-balancing loss and the capacity are defined per
group of tokens (each rank's, as in DeepSpeed-MoE and GShard), so for those it runs the dp
shards of the batch one after another (still one process, the loss the mean of theirs) and
drops the tokens an independent rule picks (each expert keeps the first ceil(cf x pairs /
experts) of a shard's pairs in token order).

Tolerances (as in test_boost_parity): the parallel runs sum the same products in another
order (experts see their tokens in other batches, gradients are reduced over ranks) — fp32
rounding, ~1e-7 relative per step. SGD (lr 0.5) moves a parameter by lr x gradient: those
differences stay below 1e-6 after 3 steps (measured max 6e-8), so parameters are compared at
rtol 1e-5 / atol 1e-6, where a gradient off by a factor ep or dp (a missing or doubled
division) moves them by ~1e-3. Adam divides by sqrt(v), which turns rounding in near-zero
gradients into visible steps for a few elements (eps 1e-4 limits it): rtol 1e-4 / atol 1e-5
(measured max 2.3e-7). Gradients: rtol 1e-5 / atol 2e-7 (elements ~1e-4..1e-1, rounding ~1e-7
relative; measured max 7e-8 absolute). Losses (~4.86) and the global gradient norm: rtol 1e-5
/ atol 1e-6 (measured max 4.8e-7 and 1.2e-7).
"""

import math
import time
from dataclasses import dataclass, field

import pytest
import torch
from tiny_lm import tiny_llama
from tiny_moe import EXPERTS, SEQ, VOCAB, tiny_moe

import tessera
from tessera.parallel.experts import a2a_bytes, dispatches
from tessera.runtime import spawn
from tessera.train.export import full_state_dict
from tessera.train.losses import causal_lm_loss

STEPS, GLOBAL_BATCH, HIDDEN, LAYERS = 3, 8, 32, 2
CLIP = 0.5  # below the first step's gradient norms (~1.2): clipping is active


@dataclass(frozen=True)
class Case:
    family: str
    plan: dict
    kind: str = "sgd"
    aux: bool = False  # the model's loss with its load-balancing term (output_router_logits)
    uneven: bool = False  # router weights forcing empty experts (see _force_uneven)
    config: dict = field(default_factory=dict)
    batch: tuple[int, int] = (GLOBAL_BATCH, SEQ)  # global batch x tokens


TWO_RANKS = [
    Case("mixtral", dict(dp=2, ep=2)),
    Case("mixtral", dict(dp=2, ep=2), "adamw"),
    Case("qwen2_moe", dict(dp=2, ep=2, zero=1, chunk_mib=0.01), "adamw"),
    Case("qwen2_moe", dict(dp=2, ep=2, zero=3, chunk_mib=0.01, max_grad_norm=CLIP)),
    Case("mixtral", dict(dp=2, ep=2, zero=3, chunk_mib=0.01, max_grad_norm=CLIP), "adamw"),
    Case("mixtral", dict(dp=2, ep=2, zero=2), uneven=True),
    Case("mixtral", dict(dp=2, ep=2, zero=1, capacity_factor=1.0)),
    # router_aux_loss_coef 0.5 (not 0.001) so the term moves the router visibly
    Case("mixtral", dict(dp=2, ep=2), "adamw", aux=True, config=dict(router_aux_loss_coef=0.5)),
    Case("mixtral", dict(dp=2, ep=2, zero=1, precision="bf16"), "adamw"),
    Case("qwen2_moe", dict(dp=2, ep=2, zero=3, chunk_mib=0.01, precision="bf16")),
    Case("qwen3_moe", dict(dp=2, ep=2, activation_checkpointing=True)),
    Case(
        "mixtral", dict(dp=2, ep=2, zero=3, chunk_mib=0.01, activation_checkpointing=True, max_grad_norm=CLIP)
    ),
]

FOUR_RANKS = [
    Case("mixtral", dict(dp=4, ep=2, zero=1), "adamw"),
    Case("mixtral", dict(dp=4, ep=2, zero=3, chunk_mib=0.01)),
    Case("qwen2_moe", dict(dp=4, ep=2, zero=3, max_grad_norm=CLIP), "adamw"),
    Case("qwen3_moe", dict(dp=4, ep=4, zero=2, chunk_mib=0.01)),
    # ep2 x tp2: the attention tensor-parallel by the model's own plan, the MoE blocks by ep
    Case("mixtral", dict(dp=2, tp=2, ep=2, zero=1), "adamw"),
    Case("qwen3_moe", dict(dp=2, tp=2, ep=2, zero=3, chunk_mib=0.01, max_grad_norm=CLIP)),
    # 3 rows x 11 tokens per dp rank: tp slices of 17 and 16 tokens (padded for the gathers)
    Case("mixtral", dict(dp=2, tp=2, ep=2), batch=(6, 11)),
    # ep2 x pp2: one MoE layer per stage, each stage's experts over its two dp ranks
    Case("mixtral", dict(dp=2, pp=2, ep=2)),
    Case(
        "qwen2_moe",
        dict(dp=2, pp=2, ep=2, zero=1, max_grad_norm=CLIP, activation_checkpointing=True),
        "adamw",
    ),
]


# ---- models, data, losses -------------------------------------------------------------------
def _build(case: Case):
    model = tiny_moe(case.family, **case.config)
    if case.uneven:
        _force_uneven(model)
    return model


def _force_uneven(model) -> None:
    """Hidden dimension 0 of every token's embedding is 1 (the others ~0.02), so after the
    norm every router input is ~5 there. The routers ignore that dimension (0 in their rows)
    except where -1 scores an expert about -5, far below the others (|logit| < 0.1): layer 0
    never picks experts 0-3 (ep rank 0 receives no token), layer 1 never expert 5 (ep rank 1
    none for it); the other experts share the tokens."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer, avoided in ((0, slice(0, 4)), (1, slice(5, 6))):
            gate = model.model.layers[layer].mlp.gate.weight
            gate[:, 0] = 0.0
            gate[avoided, 0] = -1.0


def _batches(case: Case):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, case.batch, generator=g) for _ in range(STEPS)]


def _aux_loss(model, batch):
    """The model's own loss: cross-entropy + router_aux_loss_coef x load-balancing loss."""
    return model(input_ids=batch, labels=batch, output_router_logits=True).loss


def _loss(case: Case):
    return _aux_loss if case.aux else causal_lm_loss


def _optimizer(model, kind: str):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    # eps 1e-4: some true gradients are exactly zero, and Adam would turn their rounding noise
    # into lr-sized steps
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.0)


def _record_routes(model) -> list[torch.Tensor]:
    """Every router call's chosen experts (tokens x top-k), in call order (not activation
    checkpointing's recomputations, which route the same tokens again)."""
    routes: list[torch.Tensor] = []

    def record(module, args, out, experts):
        if getattr(getattr(experts, "_tessera_dispatch", None), "counting", True):
            routes.append(out[2].detach().clone())

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, a, out, e=layer.mlp.experts: record(m, a, out, e))
    return routes


def _kept(route: torch.Tensor, capacity_factor: float | None) -> torch.Tensor:
    """Which (token, slot) pairs an expert keeps: the first ceil(cf x pairs / experts) of each
    expert's in token order (all without a capacity factor). Written apart from the dispatch."""
    flat = route.reshape(-1)
    if capacity_factor is None:
        return torch.ones_like(flat, dtype=torch.bool)
    capacity = math.ceil(capacity_factor * flat.numel() / EXPERTS)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    for expert in range(EXPERTS):
        keep[(flat == expert).nonzero().flatten()[:capacity]] = True
    return keep


def _capacity_hooks(model, capacity_factor: float) -> None:
    """Reference: the dropped pairs' router weights are zero (their expert output counts nothing)."""

    def drop(module, args):
        hidden, route, weights = args
        keep = _kept(route, capacity_factor).view_as(route)
        return hidden, route, weights.masked_fill(~keep, 0.0)

    for layer in model.model.layers:
        layer.mlp.experts.register_forward_pre_hook(drop)


# ---- the runs -------------------------------------------------------------------------------
def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(case: Case) -> dict:
    model = _build(case)
    routes = _record_routes(model)
    dtypes: set[torch.dtype] = set()  # of the attention's projections: autocast reached the ranks
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: dtypes.add(out.dtype))
    model, opt = tessera.boost(model, _optimizer(model, case.kind), tessera.Plan(**case.plan))
    routes.clear()  # boost's own probes (pipeline stages checked and shaped) are no training
    ledger = opt.mesh.comm.ledger
    losses, norms, moved = [], [], []
    for batch in _batches(case):
        before = ledger.total(op="all_to_all", axis="ep")
        stats = opt.train_step(batch, _loss(case))
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
        moved.append(ledger.total(op="all_to_all", axis="ep") - before)
    grads = None
    if (
        case.plan.get("zero", 0) <= 1 and "max_grad_norm" not in case.plan
    ):  # p.grad holds the reduced gradient
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    state = full_state_dict(model, opt)
    return dict(
        losses=losses,
        norms=norms,
        moved=moved,
        grads=grads,
        params={n: state[n] for n, _ in model.named_parameters()},
        routes=routes,
        received=[d.pairs_received for d in dispatches(model)],
        dropped=sum(d.dropped for d in dispatches(model)),
        tokens_per_expert=[d.tokens_per_expert for d in dispatches(model)],
        local_experts=model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape[0],
        dtypes=dtypes,
    )


def _worker(cases: list[Case]) -> list[dict]:
    out = []
    for case in cases:
        began = time.process_time()
        out.append(_train(case) | {"cpu_s": time.process_time() - began})
    return out


def reference(case: Case) -> dict:
    """One process; the dp shards one after another where the loss is per group (module doc)."""
    model = _build(case)
    capacity = case.plan.get("capacity_factor")
    if capacity is not None:
        _capacity_hooks(model, capacity)
    shards = case.plan["dp"] if case.aux or capacity is not None else 1
    opt = _optimizer(model, case.kind)
    losses, norms = [], []
    bf16 = case.plan.get("precision") == "bf16"
    for batch in _batches(case):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # as train_step runs it
            loss = sum(_loss(case)(model, part) for part in batch.chunk(shards)) / shards
        loss.backward()
        norm = case.plan.get("max_grad_norm")
        norms.append(
            None if norm is None else float(torch.nn.utils.clip_grad_norm_(model.parameters(), norm))
        )
        opt.step()
        losses.append(loss.item())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(losses=losses, norms=norms, grads=grads, params=dict(model.named_parameters()))


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_worker, 2, TWO_RANKS)


@pytest.fixture(scope="module")
def four_ranks():
    return spawn(_worker, 4, FOUR_RANKS)


# ---- checks ---------------------------------------------------------------------------------
MEASURED: dict[str, float] = {}  # largest error of each kind over the cases (printed with -s)


def _close(kind: str, actual, expected, rtol: float, atol: float, label: str) -> None:
    actual, expected = (
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
    )
    key = f"{kind} {'bf16' if 'bf16' in label else 'fp32'}"
    MEASURED[key] = max(MEASURED.get(key, 0.0), float((actual - expected).abs().max()))
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{label} {kind}: {m}")


def _tolerances(case: Case) -> dict[str, tuple[float, float]]:
    """(rtol, atol) per kind; fp32 as the module doc says. bf16: both runs use bf16 autocast
    (fp32 master weights), and each bf16 matmul output is rounded to 8 bits of mantissa
    (relative 2^-9 ~ 2e-3); the experts see their tokens in other groupings and the gradients
    are reduced in another order, so a rounding may fall the other way. Measured max: losses
    8.7e-5 (atol 5e-4), gradients 5.9e-4 absolute over elements up to ~0.1 (atol 2e-3, rtol
    1e-2), parameters after 3 AdamW steps of lr 1e-2 3.8e-3 (atol 1e-2: AdamW moves an element
    by up to lr per step whatever the gradient's size, so a rounding that flips a tiny
    gradient's sign shows at that scale; a missing factor dp or ep moves them by lr in most
    elements and fails the losses too)."""
    if case.plan.get("precision") == "bf16":
        return dict(loss=(0.0, 5e-4), norm=(1e-3, 1e-3), grad=(1e-2, 2e-3), param=(1e-2, 1e-2))
    param = (1e-5, 1e-6) if case.kind == "sgd" else (1e-4, 1e-5)
    return dict(loss=(1e-5, 1e-6), norm=(1e-5, 1e-6), grad=(1e-5, 2e-7), param=param)


def _check_parity(case: Case, run: dict) -> None:
    ref = reference(case)
    label = f"{case.family} {case.plan} {case.kind}{' aux' if case.aux else ''}"
    tol = _tolerances(case)
    assert run["local_experts"] == EXPERTS // case.plan["ep"], label  # the experts are split
    bf16 = case.plan.get("precision") == "bf16"
    # the loss of this tiny model moves by only ~4e-5 between fp32 and bf16 (within the bf16
    # tolerances below), so the precision is checked where it acts
    assert run["dtypes"] == {torch.bfloat16 if bf16 else torch.float32}, (label, run["dtypes"])
    _close("loss", run["losses"], ref["losses"], *tol["loss"], label)
    if ref["norms"][0] is not None:  # the global norm counts every expert once: same rounding as losses
        _close("norm", run["norms"], ref["norms"], *tol["norm"], label)
    if run["grads"] is not None:
        # pipeline stages: rank 0 holds the first stage's parameters (and their gradients)
        assert run["grads"] and run["grads"].keys() <= ref["grads"].keys(), label
        if case.plan.get("pp", 1) == 1:
            assert run["grads"].keys() == ref["grads"].keys(), label
        for name, g in run["grads"].items():
            _close("grad", g, ref["grads"][name], *tol["grad"], f"{label} {name}")
    start = dict(_build(case).named_parameters())
    for name, p in ref["params"].items():
        _close("param", run["params"][name], p.detach(), *tol["param"], f"{label} {name}")
    moved = sum(not torch.equal(p, start[n]) for n, p in ref["params"].items())
    assert moved > len(start) // 2, label  # it trained


def _peers(rank: int, plan: dict) -> tuple[list[int], range]:
    """The ranks of ``rank``'s ep group (same stage and tp coordinate, ``ep`` consecutive dp
    ranks; layout pp, dp, tp) and the experts ``rank`` holds."""
    tp, dp, ep = plan.get("tp", 1), plan["dp"], plan["ep"]
    stage, d, t = rank // (dp * tp), (rank // tp) % dp, rank % tp
    group = [stage * dp * tp + g * tp + t for g in range(d - d % ep, d - d % ep + ep)]
    local = EXPERTS // ep
    return group, range((d % ep) * local, (d % ep + 1) * local)


def _tp_slice(route: torch.Tensor, rank: int, plan: dict) -> torch.Tensor:
    """The rows of a router call's route the tp coordinate of ``rank`` dispatches (contiguous
    slices of the tokens its tp group shares, the first ones a row longer)."""
    tp = plan.get("tp", 1)
    base, extra = divmod(route.shape[0], tp)
    sizes = [base + (i < extra) for i in range(tp)]
    t = rank % tp
    return route[sum(sizes[:t]) : sum(sizes[: t + 1])]


def _check_bytes(case: Case, runs: list[dict]) -> None:
    """Each rank's all-to-all bytes per step = a2a_bytes of the pairs it sent and received,
    from the routes its and its ep peers' routers chose (exact: integers). Every router call
    of a rank (its stage's layers, each micro-batch) pairs with the same call of its peers."""
    capacity = case.plan.get("capacity_factor")
    recomputed = case.plan.get("activation_checkpointing", False)
    pp = case.plan.get("pp", 1)
    calls = LAYERS // pp * (case.plan.get("microbatches") or pp)  # router calls per step and rank
    # pipeline stages: the first step begins with torch's metadata inference, one more forward
    # of each stage (its exchanges counted in step 0's bytes): that step is not compared
    first = 1 if pp > 1 else 0
    for rank, run in enumerate(runs):
        peers, mine = _peers(rank, case.plan)
        routes = {
            r: [_tp_slice(route, rank, case.plan) for route in runs[r]["routes"][-STEPS * calls :]]
            for r in (rank, *peers)
        }
        assert len(run["routes"]) == STEPS * calls + (first * LAYERS // pp), (case, rank, len(run["routes"]))
        for step in range(first, STEPS):
            expected = 0
            for call in range(step * calls, (step + 1) * calls):
                sent = int(_kept(routes[rank][call], capacity).sum())
                received = 0
                for peer in peers:
                    route = routes[peer][call].reshape(-1)
                    kept = route[_kept(route, capacity)]
                    received += int(sum((kept == e).sum() for e in mine))
                # bf16 autocast: the block's input and the experts' output are fp32 (measured), 4 bytes
                expected += a2a_bytes(EXPERTS, sent, received, HIDDEN, recomputed=recomputed)
            assert run["moved"][step] == expected, (case, rank, step, run["moved"][step], expected)


def test_expert_parallel_on_two_ranks(two_ranks):
    for i, case in enumerate(TWO_RANKS):
        _check_parity(case, two_ranks[0][i])
        _check_bytes(case, [rank[i] for rank in two_ranks])
    print("largest errors:", MEASURED, [round(r["cpu_s"], 2) for r in two_ranks[0]])


def test_expert_parallel_with_dp_on_four_ranks(four_ranks):
    for i, case in enumerate(FOUR_RANKS):
        _check_parity(case, four_ranks[0][i])
        _check_bytes(case, [rank[i] for rank in four_ranks])
    print("largest errors:", MEASURED, [round(r["cpu_s"], 2) for r in four_ranks[0]])


def test_uneven_routing_empties_a_rank_and_an_expert(two_ranks):
    i = next(i for i, c in enumerate(TWO_RANKS) if c.uneven)
    runs = [rank[i] for rank in two_ranks]
    per_layer = [sum(run["tokens_per_expert"][layer] for run in runs) for layer in range(LAYERS)]
    assert per_layer[0][:4].sum() == 0 and per_layer[0][4:].sum() > 0, per_layer
    assert per_layer[1][5] == 0 and (per_layer[1] > 0).sum() >= 6, per_layer
    assert runs[0]["received"][0] == 0 and runs[1]["received"][0] > 0  # rank 0: nothing in layer 0


def test_capacity_factor_drops_tokens(two_ranks):
    i = next(i for i, c in enumerate(TWO_RANKS) if "capacity_factor" in c.plan)
    runs = [rank[i] for rank in two_ranks]
    expected = sum(
        int((~_kept(route, 1.0)).sum()) for run in runs for route in run["routes"]
    )  # the independent rule's drops, every layer and step of both ranks
    assert expected > 0 and sum(run["dropped"] for run in runs) == expected


def test_aux_loss_changes_training(two_ranks):
    """The load-balancing term is in the loss both runs train on (not a no-op)."""
    case = next(c for c in TWO_RANKS if c.aux)
    plain = reference(Case(case.family, case.plan, case.kind, config=case.config))
    with_aux = reference(case)
    assert abs(with_aux["losses"][0] - plain["losses"][0]) > 1e-3  # 0.5 x a balance loss of ~2


# ---- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(dp=3, ep=2), "ep must divide dp=3"),
        (dict(dp=2, ep=2, capacity_factor=0.0), "capacity_factor must be > 0"),
        (dict(dp=2, ep=2, capacity_factor=-1), "capacity_factor must be > 0"),
        (dict(capacity_factor=1.0), "set ep > 1"),
        (dict(dp=2, ep=2, sp=2), "sp=2 is not supported yet"),
        (dict(dp=2, ep=2, pp=2, tp=2), "pp=2 and tp=2 together is not supported yet"),
        (dict(dp=2, ep=2, zero=3, offload="auto"), "offload='auto' is not supported yet"),
        (
            dict(dp=2, ep=2, tp=2, sequence_parallel_norms=True),
            "sequence_parallel_norms=True is not supported",
        ),
    ],
)
def test_plan_refuses(kwargs, words):
    with pytest.raises(ValueError, match=words) as info:
        tessera.Plan(**kwargs)
    assert "\n" not in str(info.value)


def _refusal_worker(_):
    messages = []
    for build, plan in (
        (lambda: tiny_moe("mixtral", num_local_experts=3), dict(dp=2, ep=2)),
        (tiny_llama, dict(dp=2, ep=2)),
        (lambda: tiny_moe("gpt_oss", num_local_experts=8, head_dim=8), dict(dp=2, ep=2, zero=3)),
    ):
        model = build()
        before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
        try:
            tessera.boost(model, torch.optim.SGD(model.parameters(), lr=0.1), tessera.Plan(**plan))
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
        now = dict(model.named_parameters())
        assert now.keys() == before.keys()
        assert all(now[n] is p and torch.equal(p, v) for n, (p, v) in before.items())  # untouched
        assert not any("forward" in vars(m) for m in model.modules())  # no hook installed
    return messages


def test_boost_refuses_before_changing_the_model():
    messages = spawn(_refusal_worker, 2, None)[0]
    for message, words in zip(
        messages,
        ["does not divide the 3 experts of model.layers.0.mlp.experts", "it is a dense model", "'gpt_oss'"],
        strict=True,
    ):
        assert message is not None and words in message and "\n" not in message, message
