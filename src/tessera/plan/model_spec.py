"""What the planner needs to know of a model: a transformer's shape, its parameters and its
FLOPs, as formulas (no weights, no torch).

Per layer of hidden size h, MLP width f and t tokens attending over a sequence of s:

    parameters   4h^2 + 2hf + extra_layer_params (adaLN modulation, norms, biases, cross-attention)
    forward      2 t (4h^2 + 2hf + extra_token_params)   the matmuls, 2 FLOPs a multiply-add
                 (adaLN's modulation acts on one conditioning vector, not per token)
                 + 4 t s h                       q k^T and attention x v
    training     3 x forward (backward is twice the forward), 4 x with activation
                 checkpointing (one forward again)

A mixture-of-experts spec (``experts`` > 0) has ``experts`` MLPs of width ``ffn`` per layer,
of which each token takes ``top_k``, and a router (h x experts):

    parameters   4h^2 + experts 2hf + h experts + extra_layer_params
                 (of which ``expert_layer_params`` = experts 2hf are the experts')
    forward      2 t (4h^2 + top_k 2hf + h experts + extra_token_params) + 4 t s h

The presets carry their source; ``params`` is the published total where one is stated (the
layer formula then only splits the time, it does not decide the memory).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class TransformerSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int  # MLP inner width
    tokens: int  # sequence length of one sample (image tokens + text tokens for joint attention)
    vocab: int = 0  # language models: embedding and head rows
    extra_layer_params: int = 0  # per layer beyond attention + MLP (adaLN modulation, norms, biases)
    extra_token_params: int = 0  # of those, the ones every token is multiplied by (cross-attention q, o)
    params: int | None = None  # published total; None: counted from the formula
    linear_attention: bool = False  # attention costs 4 t h^2 / heads instead of 4 t s h (SANA)
    # Eager PyTorch dispatches every aten op from the host (tessera.plan.host_ops counts them
    # per layer of the diffusers model); a layer cannot run faster than the host issues it.
    host_ops_per_layer: float = 0.0
    decode_flops: float = 0.0  # the VAE decoder's FLOPs for one sample (run once, unparallelised)
    experts: int = 0  # mixture of experts: MLPs per layer (0: a dense model)
    top_k: int = 0  # of those, the ones each token takes
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "ffn", "tokens"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {field} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}"
            )
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"model {self.name!r}: top_k must be between 1 and experts={self.experts}, got {self.top_k!r}"
            )
        if not self.experts and self.top_k:
            raise ValueError(f"model {self.name!r}: top_k={self.top_k} needs experts > 0")

    @property
    def expert_layer_params(self) -> int:
        """Parameters of one layer's experts (0 for a dense model)."""
        return self.experts * 2 * self.hidden * self.ffn

    @property
    def layer_params(self) -> int:
        mlp = (
            self.expert_layer_params + self.hidden * self.experts
            if self.experts
            else 2 * self.hidden * self.ffn
        )
        return 4 * self.hidden**2 + mlp + self.extra_layer_params

    @property
    def total_params(self) -> int:
        if self.params is not None:
            return self.params
        return self.layers * self.layer_params + self.vocab * self.hidden

    def linear_flops(self, tokens: int) -> float:
        """Forward FLOPs of one layer's matmuls for ``tokens`` tokens (MoE: the router and the
        ``top_k`` experts each token takes)."""
        mlp = 2 * self.hidden * self.ffn * (self.top_k if self.experts else 1) + self.hidden * self.experts
        return 2.0 * tokens * (4 * self.hidden**2 + mlp + self.extra_token_params)

    def attention_flops(self, queries: int, keys: int) -> float:
        """Forward FLOPs of one layer's attention: ``queries`` tokens over ``keys``."""
        if self.linear_attention:
            return 4.0 * queries * self.hidden * (self.hidden // self.heads)
        return 4.0 * queries * keys * self.hidden

    def layer_flops(self, tokens: int | None = None) -> float:
        t = self.tokens if tokens is None else tokens
        return self.linear_flops(t) + self.attention_flops(t, t)

    def head_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.vocab * self.hidden

    def with_tokens(self, tokens: int) -> TransformerSpec:
        return dataclasses.replace(self, tokens=tokens)


def dit_spec(
    name: str,
    *,
    latent: int,
    patch: int,
    layers: int,
    hidden: int,
    heads: int,
    text_tokens: int = 0,
    cross_attention: bool = False,
    adaln_single: bool = False,
    mlp_ratio: float = 4.0,
    params: int | None = None,
    source: str = "",
    **extra,
) -> TransformerSpec:
    """A DiT over a ``latent`` x ``latent`` latent cut into ``patch`` x ``patch`` patches,
    with adaLN modulation (6h^2 + 6h per layer) as DiT and PixArt have it; ``text_tokens``
    join the sequence (joint attention, Flux/SD3), ``cross_attention`` adds PixArt's
    cross-attention to the text (4h^2 parameters, q and o per image token); ``adaln_single``
    shares one modulation over all layers (PixArt), so no 6h^2 per layer."""
    return TransformerSpec(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn=int(hidden * mlp_ratio),
        tokens=(latent // patch) ** 2 + text_tokens,
        extra_layer_params=(0 if adaln_single else 6 * hidden**2 + 6 * hidden)
        + (4 * hidden**2 if cross_attention else 0),
        extra_token_params=2 * hidden**2 if cross_attention else 0,
        params=params,
        source=source,
        **extra,
    )


def gpt2_spec(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    tokens: int = 1024,
    positions: int = 1024,
    vocab: int = 50257,
) -> TransformerSpec:
    # GPT-2: learned positions (1024 x h) beside the tied embedding; 2 LayerNorms + biases per layer.
    return TransformerSpec(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn=4 * hidden,
        tokens=tokens,
        vocab=vocab,
        extra_layer_params=13 * hidden,
        params=layers * (12 * hidden**2 + 13 * hidden) + vocab * hidden + positions * hidden + 2 * hidden,
        source="Radford et al. 2019, GPT-2 configs in transformers",
    )


def _moe_spec_from_config(cfg: dict, file: Path, hidden, layers, heads, experts, tokens) -> TransformerSpec:
    """A Mixtral / Qwen2-MoE / Qwen3-MoE style config (every layer sparse, gated experts of
    ``moe_intermediate_size`` or ``intermediate_size``), its parameters counted exactly:
    grouped-query attention (``num_key_value_heads``, ``head_dim``), q/k/v biases (Qwen2),
    Qwen3's q/k norms, two norms per layer, the router, a shared expert and its gate (Qwen2-MoE),
    the embedding, an untied head and the final norm. ``extra_layer_params`` holds what is
    not 4h^2 + experts + router (it is negative where grouped-query attention is smaller)."""
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (heads + 2 * kv) + heads * head_dim * hidden
    model_type = cfg.get("model_type", "")
    if model_type == "qwen2_moe" or cfg.get("qkv_bias") or cfg.get("attention_bias"):
        attention += head_dim * (heads + 2 * kv)
    if model_type == "qwen3_moe":
        attention += 2 * head_dim  # q_norm, k_norm
    shared = cfg.get("shared_expert_intermediate_size") or 0
    shared_params = 3 * hidden * shared + hidden if shared else 0  # gated MLP + its sigmoid gate
    extra = attention - 4 * hidden**2 + 2 * hidden + shared_params
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    vocab = cfg.get("vocab_size", 0)
    spec = TransformerSpec(
        name=model_type or file.parent.name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn=width * 3 // 2,  # gated: three h x f matrices, as 2h x 1.5f
        tokens=tokens or cfg.get("max_position_embeddings", 1024),
        vocab=vocab,
        extra_layer_params=extra,
        extra_token_params=extra - 2 * hidden,  # the norms are not matmuls
        experts=experts,
        top_k=cfg.get("num_experts_per_tok", 2),
        source=str(file),
    )
    head = 0 if cfg.get("tie_word_embeddings") else vocab * hidden
    return dataclasses.replace(spec, params=layers * spec.layer_params + vocab * hidden + head + hidden)


def spec_from_config(path: str | Path, tokens: int | None = None) -> TransformerSpec:
    """A spec from a transformers ``config.json`` (GPT-2 or Llama-style keys)."""
    from tessera.plan.model_presets import PRESETS  # the presets are built from this module's specs

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"{path}: no config.json there; give a preset ({', '.join(PRESETS)}) or a model folder"
        )
    cfg = json.loads(file.read_text())
    hidden = cfg.get("hidden_size", cfg.get("n_embd"))
    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    if not (hidden and layers and heads):
        raise ValueError(f"{file}: needs hidden_size/n_embd, num_hidden_layers/n_layer and heads")
    ffn = cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * hidden
    gated = "intermediate_size" in cfg and cfg.get("hidden_act", "") in (
        "silu",
        "swiglu",
        "gelu_pytorch_tanh",
    )
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if experts:
        return _moe_spec_from_config(cfg, file, hidden, layers, heads, experts, tokens)
    return TransformerSpec(
        name=cfg.get("model_type", file.parent.name),
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn=int(ffn * 1.5) if gated else ffn,  # a gated MLP has 3 matrices of h x f: 1.5x two
        tokens=tokens or cfg.get("max_position_embeddings", cfg.get("n_positions", 1024)),
        vocab=cfg.get("vocab_size", 0),
        source=str(file),
    )


def spec_from_diffusers(folder: Path, image_tokens: int | None = None) -> TransformerSpec:
    """The transformer of a diffusers pipeline folder (PixArt, SD3, Flux configs): layers
    (Flux: double blocks count twice, as two streams), width, heads, tokens at the config's
    sample size or ``image_tokens``, plus the text tokens of joint attention."""
    file = folder / "transformer" / "config.json"
    if not file.is_file():
        raise ValueError(f"{folder}: a diffusers pipeline folder needs transformer/config.json")
    cfg = json.loads(file.read_text())
    try:
        heads, head_dim, patch = (
            cfg["num_attention_heads"],
            cfg["attention_head_dim"],
            cfg.get("patch_size", 2),
        )
        layers = cfg["num_layers"] * (2 if "num_single_layers" in cfg else 1) + cfg.get(
            "num_single_layers", 0
        )
    except KeyError as exc:
        raise ValueError(f"{file}: no {exc.args[0]!r}; not a PixArt/SD3/Flux transformer config") from None
    joint = "joint_attention_dim" in cfg
    # joint attention's text tokens at the pipelines' defaults: Flux's T5 512; SD3's CLIP 77 + T5 256
    text = (512 if "num_single_layers" in cfg else 333) if joint else 0
    tokens = image_tokens or (cfg.get("sample_size", 128) // patch) ** 2
    return dit_spec(
        cfg.get("_class_name", folder.name),
        latent=1,
        patch=1,
        layers=layers,
        hidden=heads * head_dim,
        heads=heads,
        cross_attention=not joint,
        adaln_single=not joint,
        source=str(file),
    ).with_tokens(tokens + text)


def model_spec(name: str, tokens: int | None = None) -> TransformerSpec:
    """A preset by name, a diffusers pipeline folder, or a transformers model folder /
    config.json path. ``tokens``: the sequence (for a DiT, the image tokens)."""
    from tessera.plan.model_presets import PRESETS  # the presets are built from this module's specs

    if name in PRESETS:
        spec = PRESETS[name]
        return spec.with_tokens(tokens) if tokens else spec
    if (Path(name) / "model_index.json").is_file():
        return spec_from_diffusers(Path(name), tokens)
    if Path(name).exists():
        return spec_from_config(name, tokens)
    raise ValueError(
        f"unknown model {name!r}; give a preset ({', '.join(PRESETS)}) or a transformers model folder"
    )
