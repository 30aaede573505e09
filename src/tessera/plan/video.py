"""`tessera plan generate` on a video pipeline folder (Wan 2.1, LTX-Video).

A video DiT attends over every token of the video: latent frames x token rows x token
columns (Wan's 1 x 2 x 2 patches; LTX's 1 x 1). Tessera's samplers see the video as one
image of *frame x row* rows (tessera.diffusion.adapters.wan), and every method splits those
rows, so the planner costs the same layers on ``frames x rows x cols`` tokens with the
cost model of an image DiT (tessera.plan.inference): nothing about time changes the
arithmetic of a layer. The VAE decode is in the estimate as the presets have it, once on one
rank at the end: its FLOPs counted on the meta device (``host_ops.decode_flops``).

The shape comes from the pipeline as ``tessera generate`` would run it: the folder loaded
on the meta device (``meta_pipeline``: configs, no weights) and ``prepare_run``'s noise,
after the same refusals (a frame count the VAE's temporal compression cannot take, a size
the VAE or the patches cannot cut). The layer widths are read off the model (the MLP's inner
width from its last projection) and the parameter count is the model's own, counted on
the meta device.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from tessera.plan.model_spec import TransformerSpec, dit_spec


@dataclass(frozen=True)
class VideoShape:
    """The run a video plan is for: ``frames`` pixel frames of ``height`` x ``width``,
    ``latent_frames`` after the VAE, ``rows`` frame x row token rows of ``cols`` tokens."""

    frames: int
    latent_frames: int
    height: int
    width: int
    rows: int
    cols: int

    @property
    def tokens(self) -> int:
        return self.rows * self.cols

    def describe(self) -> str:
        return (
            f"{self.frames} frames ({self.latent_frames} latent) of {self.height}x{self.width} px: "
            f"{self.latent_frames} x {self.rows // self.latent_frames} x {self.cols} = {self.tokens} tokens"
        )


def is_video_folder(path: str | Path) -> bool:
    """A diffusers pipeline folder whose pipeline makes video (WanPipeline, LTXPipeline)."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return False
    from tessera.diffusion.pipeline_families import FAMILIES

    name = json.loads(index.read_text()).get("_class_name")
    return any(f.video and name in f.names for f in FAMILIES)


def _mlp_width(model, hidden: int) -> int:
    """The inner width of the first block's MLP: the input width of its last projection
    (diffusers' FeedForward: proj in, activation, dropout, proj out)."""
    from diffusers.models.attention import FeedForward
    from torch import nn

    ff = next((m for m in model.modules() if isinstance(m, FeedForward)), None)
    if ff is None:
        return 4 * hidden
    return [m for m in ff.modules() if isinstance(m, nn.Linear)][-1].in_features


@dataclass(frozen=True)
class VideoPlan:
    """What the planner needs of a saved video pipeline for one run: its transformer as a
    spec on the run's tokens, the run's shape, and the layouts the run can take."""

    spec: TransformerSpec
    shape: VideoShape
    adapter: object  # the transformer's adapter (meta device), for check_layout

    def runnable(self, config) -> bool:
        """True where ``tessera generate`` would run ``config`` on this pipeline and shape
        (tessera.diffusion.parallel.check_layout: heads, the tensor-parallel baseline's
        model, PipeFusion's stages and patches)."""
        from tessera.diffusion.parallel import check_layout

        p = self.adapter.patch_size
        try:
            check_layout(self.adapter, config, self.shape.rows * p, self.shape.cols * p)
        except ValueError:
            return False
        return True


def video_plan(folder: str | Path, *, frames: int | None, height: int | None, width: int | None) -> VideoPlan:
    """The transformer of a saved video pipeline on the tokens of ``frames`` frames of
    ``height`` x ``width`` pixels (None: the pipeline's own defaults). A frame count or size
    that ``tessera generate`` would refuse is refused here with the same message."""
    from dataclasses import replace

    from tessera.diffusion.adapters import adapter_for
    from tessera.diffusion.layout import ParallelConfig
    from tessera.diffusion.pipeline_families import family_of
    from tessera.diffusion.pipelines import meta_pipeline, prepare_run
    from tessera.plan.host_ops import decode_flops

    pipe = meta_pipeline(folder)
    family = family_of(type(pipe).__name__)
    frames = family.default_frames if frames is None else frames
    height = height or family.default_size[0]
    width = width or family.default_size[1]
    with warnings.catch_warnings():  # the scheduler's shift at sizes the model was not made for
        warnings.simplefilter("ignore", RuntimeWarning)
        noise, _ = prepare_run(
            pipe, height=height, width=width, num_steps=1, seed=0, config=ParallelConfig(), num_frames=frames
        )
    adapter = adapter_for(pipe.transformer)
    p = adapter.patch_size
    shape = VideoShape(
        frames=frames,
        latent_frames=family.latent_frames(pipe, frames),
        height=height,
        width=width,
        rows=noise.shape[2] // p,
        cols=noise.shape[3] // p,
    )
    hidden = adapter.hidden_size
    ffn = _mlp_width(pipe.transformer, hidden)
    latent_frame = (noise.shape[2] // shape.latent_frames, noise.shape[3])  # one latent frame's rows, cols
    spec = dit_spec(
        type(pipe.transformer).__name__,
        latent=1,
        patch=1,
        layers=adapter.num_layers,
        hidden=hidden,
        heads=adapter.num_heads,
        cross_attention=True,  # both attend to the prompt in a second attention per block
        adaln_single=True,  # one time embedding; each block has only a 6h scale-shift table
        mlp_ratio=ffn / hidden,
        params=sum(t.numel() for t in pipe.transformer.parameters()),
        decode_flops=decode_flops(pipe.vae, (1, noise.shape[1], shape.latent_frames, *latent_frame)),
        source=str(Path(folder) / "transformer" / "config.json"),
    )
    return VideoPlan(replace(spec, ffn=ffn).with_tokens(shape.tokens), shape, adapter)
