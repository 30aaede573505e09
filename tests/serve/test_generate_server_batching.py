"""A batch of requests runs each request's images as that request alone would, for every
pipeline family the server takes (PixArt, SD3, Flux; Wan's videos): the rank's own batch runner
(``generate_rank.PipelineModel.run``, what every rank of a server runs), in this process on
one rank, parts with different prompts, negative prompts, image counts and seeds. The
served path itself (over HTTP, several ranks) is tested in test_generate_server*.py.

Tolerance: one uint8 level. The same computation at another batch size can round float32
differently, which can move a pixel across a uint8 boundary, no more."""

from __future__ import annotations

import io
import multiprocessing as mp
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parents[1] / "diffusion"))  # the tiny pipelines' builders
import tiny_pipelines  # noqa: E402
import tiny_wan  # noqa: E402

from tessera.diffusion.layout import ParallelConfig  # noqa: E402
from tessera.serve.generate_rank import Batch, Part, PipelineModel, Shared, StepHook  # noqa: E402


def decoded(data: bytes) -> np.ndarray:
    """A PNG's pixels, or an animated GIF's frames stacked."""
    image = Image.open(io.BytesIO(data))
    frames = []
    for k in range(getattr(image, "n_frames", 1)):
        image.seek(k)
        frames.append(np.asarray(image.convert("RGB"), dtype=np.int16))
    return np.stack(frames)


def run(model: PipelineModel, shared: Shared, parts: list[Part], batch_id: int, steps: int) -> list:
    video = model.family.video
    batch = Batch(id=batch_id, height=32 if video else 16, width=16, steps=steps, guidance=2.0,
                  parts=tuple(parts), frames=5 if video else 0)  # fmt: skip
    images, hook = model.run(batch, lambda stepper: StepHook(stepper, shared, 0, batch_id))
    # every step begun is recorded (the last one is closed by the caller)
    assert len(hook.step_seconds) == steps - 1
    return [decoded(data) for data in images]


@pytest.mark.parametrize("family", ["pixart", "sd3", "flux", "wan", "pixart-vae-chunks"])
def test_a_batch_equals_each_request_alone(family, tmp_path):
    name, _, chunked = family.partition("-")
    builders = tiny_wan if name == "wan" else tiny_pipelines
    directory = getattr(builders, f"build_{name}_pipeline")(tmp_path / name)
    config = ParallelConfig()
    vae = {"vae_chunk_rows": 4} if chunked else {}  # the server's --vae-chunk-rows reaches the decode
    model = PipelineModel(str(directory), config, config.build_mesh(), **vae)
    shared = Shared.create(mp.get_context("spawn"), 1)
    parts = [Part(request_id=1, seed=3, prompt="a red cat", count=2),
             Part(request_id=2, seed=8, prompt="a blue house by the sea", negative_prompt="dog", count=1)]  # fmt: skip
    together = run(model, shared, parts, 1, steps=3)
    alone = [img for i, part in enumerate(parts) for img in run(model, shared, [part], 2 + i, steps=3)]
    assert len(together) == len(alone) == 3
    for got, want in zip(together, alone, strict=True):
        assert abs(got - want).max() <= 1
    assert abs(together[0] - together[1]).max() > 0  # image k of a part has its own seed (seed + k)


def test_a_video_request_is_checked_in_the_server_process(tmp_path):
    """Frames the pipeline (or the layout, or the VAE split) cannot take are a 422 naming
    frames before anything reaches the ranks; an image model takes no frames."""
    from tessera.serve.generate_spec import InputError, model_spec

    directory = tiny_wan.build_wan_pipeline(tmp_path / "wan")
    spec = model_spec(str(directory), ParallelConfig(ulysses=2), [(32, 16)], {"parallel_vae": True}, ranks=2)
    assert spec.video and spec.check_frames(5, 32, 16) == 5 and spec.check_frames(None, 32, 16) == 81
    with pytest.raises(InputError, match="^frames: .*2k\\+1 frames"):
        spec.check_frames(4, 32, 16)
    image = model_spec(str(tiny_pipelines.build_pixart_pipeline(tmp_path / "pixart")), ParallelConfig())
    with pytest.raises(InputError, match="^frames: this model makes images"):
        image.check_frames(5, 16, 16)
