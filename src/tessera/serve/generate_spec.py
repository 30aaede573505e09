"""What a generation server's model accepts, known in the server's process before any rank
starts: the image sizes (each checked against the layout, as ``tessera generate`` checks
one), the classes of a class-conditional DiT, the prompt length a pipeline's text encoder
takes. A request outside them is refused with the field named; nothing reaches the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class InputError(ValueError):
    """A request field the model cannot take: 422 naming ``field``."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The server's own bounds on one request."""

    max_steps: int = 100
    max_images: int = 4  # images per request (OpenAI's n)
    max_batch_images: int = 8  # images the scheduler puts in one batch
    max_prompt_chars: int = 2000
    batching: bool = True  # False: one request per batch (the baseline)

    def __post_init__(self) -> None:
        for name in ("max_steps", "max_images", "max_batch_images", "max_prompt_chars"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_batch_images < self.max_images:
            raise ValueError(
                f"max_batch_images {self.max_batch_images} is below max_images {self.max_images}: "
                "one request's images must fit a batch"
            )


# the prompt length each family's pipeline encodes (its encode_prompt default; SD3 and Flux: their
# CLIP tokenizer's 77, past which CLIP drops the rest): longer is refused, not silently cut
_TOKEN_LIMITS = {"PixArtAlphaPipeline": 120, "PixArtSigmaPipeline": 300, "StableDiffusion3Pipeline": 77,
                 "FluxPipeline": 77, "WanPipeline": 226, "LTXPipeline": 128}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    kind: str  # "class" (a Tessera DiT checkpoint) or "text" (a diffusers pipeline)
    sizes: tuple[tuple[int, int], ...]  # (height, width) in pixels; the first is the default
    num_classes: int = 0
    token_limit: int = 0
    tokenizer: object | None = None
    default_frames: int = 0  # a video pipeline's (0: the model makes images)
    meta: object | None = None  # the pipeline without weights: a video request's frames are checked on it
    config: object | None = None  # the layout
    vae: dict | None = None  # parallel_vae / vae_chunk_rows: a video's frames are checked against them too
    ranks: int = 1

    @property
    def video(self) -> bool:
        return self.default_frames > 0

    def check_frames(self, frames: int | None, height: int, width: int) -> int:
        """A video request's frame count (default: the pipeline's), checked as the ranks would
        check it; an image model takes none."""
        if not self.video:
            if frames is not None:
                raise InputError("frames", "this model makes images; frames are for video pipelines")
            return 0
        from tessera.diffusion.pipelines import check_vae_split, prepare_run

        frames = frames or self.default_frames
        vae = self.vae or {}
        try:
            noise, _ = prepare_run(self.meta, height=height, width=width, num_steps=1, seed=0, config=self.config,
                                   num_frames=frames)  # fmt: skip
            if vae.get("parallel_vae") or vae.get("vae_chunk_rows"):
                check_vae_split(
                    self.meta, noise, self.ranks if vae.get("parallel_vae") else 1, num_frames=frames
                )
        except ValueError as exc:
            raise InputError("frames", str(exc)) from None
        return frames

    @property
    def default_size(self) -> tuple[int, int]:
        return self.sizes[0]

    def size_names(self) -> list[str]:
        return [f"{w}x{h}" for h, w in self.sizes]

    def parse_size(self, text: str | None) -> tuple[int, int]:
        """OpenAI's "WIDTHxHEIGHT" -> (height, width), one of the served sizes."""
        if text is None or text == "auto":
            return self.default_size
        for (h, w), name in zip(self.sizes, self.size_names(), strict=True):
            if text == name:
                return h, w
        raise InputError("size", f"{text!r} is not served; choose one of {', '.join(self.size_names())}")

    def check_size(self, height: int, width: int) -> None:
        if (height, width) not in self.sizes:
            raise InputError(
                "height" if all(h != height for h, _ in self.sizes) else "width",
                f"{width}x{height} (width x height) is not served; choose one of {', '.join(self.size_names())}",
            )

    def class_of(self, prompt: str) -> int:
        """A class-conditional model's OpenAI prompt: the class number as text."""
        text = prompt.strip()
        if not text.isdigit() or int(text) >= self.num_classes:
            raise InputError(
                "prompt",
                f"this model is class-conditional: give a class number 0..{self.num_classes - 1} "
                f"as the prompt, got {prompt[:40]!r}",
            )
        return int(text)

    def check_labels(self, labels: list[int]) -> None:
        bad = [c for c in labels if not 0 <= c < self.num_classes]
        if bad:
            raise InputError("labels", f"classes must be 0..{self.num_classes - 1}, got {bad[:5]}")

    def check_prompt(self, field: str, prompt: str) -> None:
        if self.kind != "text" or not prompt:
            return
        count = len(self.tokenizer(prompt).input_ids)
        if count > self.token_limit:
            raise InputError(
                field,
                f"{count} tokens is more than the {self.token_limit} the text encoder takes; shorten it",
            )


def model_spec(directory: str, config, sizes: list[tuple[int, int]] | None = None, vae: dict | None = None,
               ranks: int = 1) -> ModelSpec:  # fmt: skip
    """The spec of the model in ``directory`` under ``config``; every size is checked as the
    ranks would check it (``check_layout``; a parallel or chunked VAE decode: ``vae``), so a
    size the layout cannot split is refused at start-up, not per request."""
    from tessera.diffusion.pipelines import is_pipeline_dir

    if is_pipeline_dir(directory):
        return _pipeline_spec(directory, config, sizes, vae or {}, ranks)
    given = [f"--{k.replace('_', '-')}" for k, v in (vae or {}).items() if v]
    if given:
        raise ValueError(f"{' and '.join(given)}: {directory} is a Tessera DiT checkpoint, which has no VAE "
                         "(it samples pixels); drop them")  # fmt: skip
    return _dit_spec(directory, config, sizes)


def _dit_spec(directory: str, config, sizes) -> ModelSpec:
    from tessera.diffusion.adapters import adapter_for
    from tessera.diffusion.parallel import check_layout
    from tessera.train.checkpoint import load_dit

    model = load_dit(directory)  # an unusable checkpoint fails here, before any rank starts
    own = model.config.image_size
    if sizes and any(s != (own, own) for s in sizes):
        raise ValueError(f"{directory} is a Tessera DiT checkpoint, which samples at its own size {own}x{own}; "
                         "drop --sizes")  # fmt: skip
    check_layout(adapter_for(model), config, own, own)
    return ModelSpec(name=Path(directory).name, kind="class", sizes=((own, own),),
                     num_classes=model.config.num_classes)  # fmt: skip


def _pipeline_spec(directory: str, config, sizes, vae: dict, ranks: int) -> ModelSpec:
    from transformers import AutoTokenizer

    from tessera.diffusion.pipeline_families import family_of
    from tessera.diffusion.pipelines import check_vae_split, meta_pipeline, prepare_run

    meta = meta_pipeline(directory)
    family = family_of(type(meta).__name__)
    if family.video:  # the video pipelines' __call__ defaults
        default = tuple(family.default_size)
    else:
        latent = getattr(meta, "default_sample_size", None) or meta.transformer.config.sample_size
        default = (latent * meta.vae_scale_factor,) * 2
    chosen = tuple(sizes) if sizes else (default,)
    for height, width in chosen:
        try:
            noise, _ = prepare_run(meta, height=height, width=width, num_steps=1, seed=0, config=config)
            if vae.get("parallel_vae") or vae.get("vae_chunk_rows"):
                check_vae_split(meta, noise, ranks if vae.get("parallel_vae") else 1)
        except ValueError as exc:
            raise ValueError(f"size {width}x{height}: {exc}") from None
    name = type(meta).__name__
    tokenizer = AutoTokenizer.from_pretrained(Path(directory) / "tokenizer")
    limit = min(_TOKEN_LIMITS.get(name, 77), tokenizer.model_max_length)
    return ModelSpec(name=Path(directory).name, kind="text", sizes=chosen, token_limit=limit, tokenizer=tokenizer,
                     default_frames=family.default_frames if family.video else 0, meta=meta, config=config,
                     vae=vae, ranks=ranks)  # fmt: skip


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``--sizes 64x64,64x32`` (WIDTHxHEIGHT, as OpenAI writes them) -> [(height, width)]."""
    out = []
    for item in text.split(","):
        w, _, h = item.strip().partition("x")
        if not (w.isdigit() and h.isdigit()) or int(w) < 1 or int(h) < 1:
            raise ValueError(f"--sizes: {item!r} is not WIDTHxHEIGHT, e.g. 64x64")
        out.append((int(h), int(w)))
    return out
