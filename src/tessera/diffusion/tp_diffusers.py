"""Megatron-style tensor parallel plans for diffusers' DiTs (the model's own classes, applied
from outside as Tessera's DiT's ``tessera.parallel.tp_plans.DIT`` is): in every block the
self-attention's and the cross-attention's q/k/v projections are split by heads (colwise),
their output projections by input features (rowwise: one all-reduce each), and the MLP's
hidden units likewise (one all-reduce after it). Each attention module's ``heads`` is set to
the local count while sharded (the processors reshape with it) and restored after.

Wan 2.1's query/key norms (and LTX-Video's) are RMSNorms over all heads together
(``norm_q``/``norm_k`` over the inner width): normalising each rank's heads alone would be a
different model. While sharded they are replaced by :class:`HeadSplitRMSNorm`, which
all-reduces each token's sum of squares over the tp ranks (a functional collective, counted
under ``tp`` with DTensor's) and so computes the whole norm exactly. LTX-Video also rotates
q and k over the whole width (before the heads are split): each rank's self-attention is
handed its heads' columns of the rotary tables. PixArt has no query/key norm.

A LoRA loaded with ``load_lora_weights`` wraps the split projections in peft layers. While
sharded, each wrapped projection the plan splits is replaced by the plain Linear it computes
(:func:`plain_projections`): a fused LoRA's base layer (the update is in its weight), or an
unfused one's base weight plus every active adapter's update (``get_delta_weight``: the same
model, rounded once where peft adds the low-rank product per call); the wrappers come back
after. LoRA variants (DoRA) are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tessera.parallel.tp_plans import TPPlan, check_plan, path_matches

# class name -> (block list attribute, the attention modules of a block, its MLP)
_FAMILIES = {
    "WanTransformer3DModel": ("blocks", ("attn1", "attn2"), "ffn"),
    "LTXVideoTransformer3DModel": ("transformer_blocks", ("attn1", "attn2"), "ff"),
    "PixArtTransformer2DModel": ("transformer_blocks", ("attn1", "attn2"), "ff"),
}


DIFFUSERS_TP = tuple(_FAMILIES)
# diffusers FeedForward activations (net.0: a Linear ``proj`` then a function of each unit)
_ELEMENTWISE = ("GELU", "ApproximateGELU")


def supports(model: nn.Module) -> bool:
    return type(model).__name__ in _FAMILIES


def diffusers_plan(model: nn.Module) -> TPPlan:
    """The plan of a supported diffusers DiT; a ValueError naming the class otherwise."""
    name = type(model).__name__
    if name not in _FAMILIES:
        raise ValueError(
            f"no tensor parallel plan for {name}; diffusers DiTs with one: {', '.join(_FAMILIES)}"
        )
    blocks, attentions, mlp = _FAMILIES[name]
    layers: dict[str, str] = {}
    for attn in attentions:
        for proj in ("to_q", "to_k", "to_v"):
            layers[f"{blocks}.*.{attn}.{proj}"] = "colwise"
        layers[f"{blocks}.*.{attn}.to_out.0"] = "rowwise"
    layers[f"{blocks}.*.{mlp}.net.0.proj"] = "colwise"  # FeedForward: act(proj), dropout, Linear
    layers[f"{blocks}.*.{mlp}.net.2"] = "rowwise"
    heads = {f"{blocks}.*.{attn}": "heads" for attn in attentions}
    return TPPlan(family=name, layers=layers, head_counts=heads)


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    blocks, attentions, _ = _FAMILIES[type(model).__name__]
    return [
        (f"{blocks}.{i}.{a}", getattr(block, a))
        for i, block in enumerate(getattr(model, blocks))
        for a in attentions
    ]


def check_diffusers_tp(model: nn.Module, degree: int) -> None:
    """Every refusal of ``degree``-way tensor parallel on ``model`` before any rank starts (it
    reads attributes only: a model on the meta device will do): the class, the processors
    (the model's own, which reshape by ``heads``), fused projections, image key/value
    projections, a norm between the projections that the split would change, and every
    split size (heads, q/k/v widths, MLP hidden units) against the degree, with the numbers."""
    plan = diffusers_plan(model)
    own = _own_processor(model)
    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError(
            f"{type(model).__name__} has diffusers' own parallelism enabled (enable_parallelism); "
            "Tessera splits the model itself: load it without"
        )
    for path, attn in _attention_modules(model):
        if getattr(attn, "fused_projections", False):
            raise ValueError(
                f"{path} has fused q/k/v projections (fuse_qkv_projections); the tensor parallel plan "
                "splits to_q/to_k/to_v: call unfuse_qkv_projections() first"
            )
        if getattr(attn, "add_k_proj", None) is not None:
            raise ValueError(f"{path} has image key/value projections (add_k_proj), which tp does not split")
        for norm in ("norm_q", "norm_k"):
            proj = attn.to_q if norm == "norm_q" else attn.to_k
            _check_norm(path, norm, getattr(attn, norm, None), proj.out_features)
        _check_linears(
            path,
            [("to_q", attn.to_q), ("to_k", attn.to_k), ("to_v", attn.to_v), ("to_out.0", attn.to_out[0])],
        )
        for other in ("spatial_norm", "group_norm", "norm_cross"):
            if getattr(attn, other, None) is not None:
                raise ValueError(f"{path} has {other}, which tensor parallel does not split")
        if type(attn.processor) is not own:
            raise ValueError(
                f"{path} runs processor {type(attn.processor).__name__}; tensor parallel runs the model's "
                f"own {own.__name__} (which reshapes by the local head count): set that processor"
            )
    blocks, _, mlp = _FAMILIES[type(model).__name__]
    for i, block in enumerate(getattr(model, blocks)):
        ff = getattr(block, mlp)
        act = type(ff.net[0]).__name__
        if act not in _ELEMENTWISE:
            raise ValueError(
                f"{blocks}.{i}.{mlp} uses activation {act}; tensor parallel splits an MLP whose "
                f"activation acts on each hidden unit alone ({', '.join(_ELEMENTWISE)}): a gated one "
                "(GEGLU, SwiGLU) would split its value and gate halves apart"
            )
        _check_linears(f"{blocks}.{i}.{mlp}", [("net.0.proj", ff.net[0].proj), ("net.2", ff.net[2])])
    with plain_projections(model, check_only=True):  # the plan's styles see the Linears they will split
        check_plan(model, plan, degree)


def _check_linears(path: str, named: list[tuple[str, nn.Module]]) -> None:
    """The split projections must be plain Linears or peft LoRA layers around one (which
    ``plain_projections`` turns into the Linear they compute)."""
    for name, module in named:
        if _lora_base(module) is not None:
            _lora_plain(f"{path}.{name}", module, check_only=True)
        elif type(module) is not nn.Linear:
            kind = f"{type(module).__module__}.{type(module).__name__}"
            raise ValueError(
                f"{path}.{name} is a {kind}, not a torch.nn.Linear or a LoRA layer around one; tensor "
                "parallel splits plain projections only"
            )


def _lora_base(module: nn.Module) -> nn.Linear | None:
    """The Linear a peft LoRA layer wraps; None for anything else."""
    base = getattr(module, "base_layer", None)
    return base if type(base) is nn.Linear and hasattr(module, "get_delta_weight") else None


def _lora_plain(path: str, module: nn.Module, *, check_only: bool = False) -> nn.Linear | None:
    """The plain Linear a peft LoRA layer computes (see the module doc)."""
    base = module.base_layer
    active = [a for a in module.active_adapters if a in module.lora_A]
    variants = [a for a in active if a in getattr(module, "lora_variant", {})]
    if variants:
        raise ValueError(
            f"{path}: adapter {variants[0]!r} is a LoRA variant (e.g. DoRA), which tensor parallel does "
            "not merge; a plain LoRA, fused or not, runs under tp"
        )
    if module.disable_adapters and module.merged:
        raise ValueError(
            f"{path}: its LoRA is fused into the weight but disabled (peft would unfuse it at the next call); "
            "unfuse_lora() or enable it before tensor parallel"
        )
    if check_only:
        return None
    if module.merged or module.disable_adapters or not active:
        return base  # its weight is what the layer computes with
    plain = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                      device=base.weight.device, dtype=base.weight.dtype)  # fmt: skip
    with torch.no_grad():
        weight = base.weight.detach().clone()
        for adapter in active:
            weight += module.get_delta_weight(adapter).to(weight.dtype)
        plain.weight.copy_(weight)
        if base.bias is not None:
            plain.bias.copy_(base.bias)
    return plain.requires_grad_(False)


@contextmanager
def plain_projections(model: nn.Module, *, check_only: bool = False) -> Iterator[None]:
    """While inside: every projection the plan splits that a peft LoRA layer wraps replaced
    by the plain Linear it computes (``check_only``: by its base layer, same shapes, nothing
    computed); the LoRA layers put back after."""
    patterns = list(diffusers_plan(model).layers)
    modules = dict(model.named_modules())
    swapped = []
    for path, module in modules.items():
        if _lora_base(module) is None or not any(path_matches(pattern, path) for pattern in patterns):
            continue
        parent, _, name = path.rpartition(".")
        plain = module.base_layer if check_only else _lora_plain(path, module)
        swapped.append((modules[parent], name, module, plain is module.base_layer))
        modules[parent]._modules[name] = plain
    try:
        yield
    finally:
        for parent, name, module, is_base in swapped:
            if is_base:  # what stands there now is the base layer (gather_tp rebuilds it whole)
                module.base_layer = parent._modules[name]
            parent._modules[name] = module


def _own_processor(model: nn.Module) -> type:
    if type(model).__name__ == "WanTransformer3DModel":
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        return WanAttnProcessor
    if type(model).__name__ == "LTXVideoTransformer3DModel":
        from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor

        return LTXVideoAttnProcessor
    from diffusers.models.attention_processor import AttnProcessor2_0

    return AttnProcessor2_0


def _check_norm(path: str, name: str, norm: nn.Module | None, width: int) -> None:
    if norm is None or isinstance(norm, nn.Identity):
        return
    if not isinstance(norm, nn.RMSNorm) or tuple(norm.normalized_shape) != (width,):
        shape = tuple(getattr(norm, "normalized_shape", ()))
        raise ValueError(
            f"{path}.{name} is a {type(norm).__name__} over {shape or 'its input'}; tensor parallel keeps "
            f"query/key norms exact for a torch RMSNorm over the projection's whole width ({width}) only"
        )


class HeadSplitRMSNorm(nn.Module):
    """An RMSNorm over a width split into ``degree`` contiguous slices, one per rank, given
    this rank's slice: each token's sum of squares is all-reduced over ``group`` before it
    is divided by the whole width, so the output is this rank's slice of the whole norm."""

    def __init__(self, norm: nn.RMSNorm, group, rank: int, degree: int):
        super().__init__()
        (self.width,) = norm.normalized_shape
        self.eps = norm.eps  # None: the computation dtype's machine epsilon, as torch's
        self.group = group
        local = self.width // degree
        self.weight = None
        if norm.weight is not None:
            self.weight = nn.Parameter(
                norm.weight.detach()[rank * local : (rank + 1) * local].clone(), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_reduce

        # as torch's rms_norm: computed in float32 (float64 for float64), the weight applied
        # before the cast back
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        squares = all_reduce(wide.pow(2).sum(-1, keepdim=True), "sum", self.group)
        eps = torch.finfo(wide.dtype).eps if self.eps is None else self.eps
        out = wide * torch.rsqrt(squares / self.width + eps)
        return (out if self.weight is None else out * self.weight).type_as(x)


def _split_norm(norm: nn.RMSNorm, group, rank: int, degree: int) -> nn.Module:
    return HeadSplitRMSNorm(norm, group, rank, degree)


def _rotary_columns(lo: int, hi: int):
    """A pre-hook giving an attention module the columns [lo, hi) of its rotary tables:
    LTX-Video rotates q and k over the whole width before splitting heads, so each rank
    takes the (cos, sin) columns of its heads (whole rotated pairs: a head is even)."""

    def hook(module, args, kwargs):
        rotary = kwargs.get("image_rotary_emb")
        if rotary is not None:
            kwargs["image_rotary_emb"] = tuple(t[..., lo:hi] for t in rotary)
        return args, kwargs

    return hook


@contextmanager
def split_norms(model: nn.Module, group, rank: int, degree: int) -> Iterator[None]:
    """While sharded: every attention's RMSNorm query/key norm replaced by its tp-split
    version, and (LTX-Video) each self-attention given its heads' rotary columns; the
    originals restored after."""
    swapped, hooks = [], []
    for path, attn in _attention_modules(model):
        for name in ("norm_q", "norm_k"):
            norm = getattr(attn, name, None)
            if isinstance(norm, nn.RMSNorm):
                swapped.append((attn, name, norm))
                setattr(attn, name, _split_norm(norm, group, rank, degree))
        if type(model).__name__ == "LTXVideoTransformer3DModel" and path.endswith("attn1"):
            local = attn.inner_dim // degree
            hook = _rotary_columns(rank * local, (rank + 1) * local)
            hooks.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for handle in hooks:
            handle.remove()
        for attn, name, norm in swapped:
            setattr(attn, name, norm)
