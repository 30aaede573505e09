"""`tessera generate`: its command-line flags and handlers (sampling a Tessera DiT
checkpoint or a saved diffusers pipeline, on one or several processes). The work is in
tessera.diffusion; this sits beside cli.py because it also reads training checkpoints."""

from __future__ import annotations

import argparse

from tessera.cli_flags import LAYOUT, add_fields, given


def build_layout(args: argparse.Namespace):
    """The ParallelConfig from the layout flags given (its own defaults otherwise)."""
    from tessera.diffusion.layout import ParallelConfig

    return ParallelConfig(**given(args, LAYOUT))


def _layout(args: argparse.Namespace):
    config = build_layout(args)
    if config.world_size != args.nproc:
        raise ValueError(
            f"parallel layout {config.describe()} needs {config.world_size} processes but --nproc is {args.nproc}"
        )
    return config


def _check_layout(model, config, steps: int) -> None:
    """What each rank's ``parallel_sample`` would refuse, refused here before any starts."""
    from tessera.diffusion.adapters import adapter_for
    from tessera.diffusion.parallel import check_layout, check_steps

    size = model.config.image_size
    check_layout(adapter_for(model), config, size, size)
    check_steps(config, steps)


def _generate_rank(model_dir: str, labels, config, steps: int, guidance: float, seed: int, progress: bool):
    from tessera.diffusion.parallel import parallel_sample
    from tessera.diffusion.pipefusion import release_other_stages
    from tessera.train.checkpoint import load_dit

    model = load_dit(model_dir)
    size = model.config.image_size
    mesh = config.build_mesh()
    if config.method == "pipefusion" and config.pipefusion > 1:
        release_other_stages(model, config, mesh)  # each stage holds only its own blocks
    images = parallel_sample(
        model,
        labels,
        config=config,
        mesh=mesh,
        height=size,
        width=size,
        num_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        progress=progress,
    )
    from tessera.runtime.mesh import global_rank

    return images if global_rank() == 0 else None


def _size(pipe, args: dict) -> tuple[int, int]:
    """(height, width) in pixels: as asked, else the pipeline's own default size."""
    from tessera.diffusion.pipeline_families import family_of

    family = family_of(type(pipe).__name__)
    if family.video:  # the video pipelines' __call__ defaults
        return args["height"] or family.default_size[0], args["width"] or family.default_size[1]
    latent = getattr(pipe, "default_sample_size", None) or pipe.transformer.config.sample_size
    return args["height"] or latent * pipe.vae_scale_factor, args["width"] or latent * pipe.vae_scale_factor


def _pipeline_rank(model_dir: str, args: dict, config):
    from tessera.diffusion.pipelines import generate, load_pipeline
    from tessera.runtime.mesh import global_rank

    pipe = load_pipeline(model_dir, with_text_encoder=global_rank() == 0)
    pipe.set_progress_bar_config(disable=True)
    if args.get("lora"):
        from tessera.diffusion.lora import load_lora

        load_lora(pipe, args["lora"], fuse=args.get("fuse_lora", False))
    height, width = _size(pipe, args)
    image = generate(
        pipe,
        prompt=args["prompt"],
        negative_prompt=args["negative_prompt"],
        height=height,
        width=width,
        num_steps=args["steps"],
        guidance_scale=args["guidance"],
        seed=args["seed"],
        config=config,
        progress=global_rank() == 0,
        parallel_vae=args.get("parallel_vae", False),
        vae_chunk_rows=args.get("vae_chunk_rows"),
        num_frames=args.get("frames"),
        num_images_per_prompt=args.get("images_per_prompt") or 1,
    )
    return image


DEFAULT_DIGITS, DEFAULT_PER_DIGIT = "0123456789", 10
DEFAULT_OUT = "grid.png"
# The flags one kind of model takes and the other would ignore: refused by name instead.
CLASS_FLAGS = ("digits", "per_digit")
TEXT_FLAGS = ("prompt", "negative_prompt")
SIZE_FLAGS = ("height", "width")


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n) not in (None, "")]


def refuse_other_conditioning(args: argparse.Namespace, pipeline: bool) -> None:
    """A flag the model would ignore is a one-line error naming it and what the model takes:
    a diffusers pipeline is text-conditioned (--prompt), a Tessera DiT checkpoint is
    class-conditional (--digits) and samples at its own size."""
    if pipeline:
        wrong = _given(args, CLASS_FLAGS)
        if wrong:
            raise ValueError(
                f"{' and '.join(wrong)}: {args.model} is a text-conditioned diffusers pipeline, "
                "which takes no classes; describe the image with --prompt"
            )
        return
    kind = f"{args.model} is read as a class-conditional Tessera DiT checkpoint (no model_index.json)"
    wrong = _given(args, TEXT_FLAGS)
    if wrong:
        raise ValueError(
            f"{' and '.join(wrong)}: {kind}, which takes no text; "
            f"choose its classes with --digits (e.g. --digits {DEFAULT_DIGITS})"
        )
    wrong = _given(args, SIZE_FLAGS)
    if wrong:
        raise ValueError(f"{' and '.join(wrong)}: {kind}, which samples at its own image size; drop them")
    wrong = [
        f for f, v in (("--parallel-vae", args.parallel_vae), ("--vae-chunk-rows", args.vae_chunk_rows)) if v
    ]
    if wrong:
        raise ValueError(f"{' and '.join(wrong)}: {kind}, which has no VAE (it samples pixels); drop them")


def cmd_generate_pipeline(args: argparse.Namespace) -> None:
    from tessera.diffusion.image_grid import check_writable
    from tessera.diffusion.pipelines import meta_pipeline, prepare_run
    from tessera.runtime import spawn

    refuse_other_conditioning(args, pipeline=True)
    if not args.prompt:
        raise ValueError(f"{args.model} is a diffusers pipeline: give a --prompt")
    from tessera.diffusion.pipeline_families import family_of

    config = _layout(args)
    meta = meta_pipeline(args.model)
    video = family_of(type(meta).__name__).video
    out = check_writable(args.out or ("video.gif" if video else DEFAULT_OUT), ".gif" if video else ".png")
    job = {
        k: getattr(args, k)
        for k in (
            "prompt",
            "negative_prompt",
            "height",
            "width",
            "steps",
            "guidance",
            "seed",
            "parallel_vae",
            "vae_chunk_rows",
            "frames",
            "lora",
            "fuse_lora",
            "images_per_prompt",
        )
    }
    # what the ranks would refuse, refused here on the weightless pipeline before any starts
    height, width = _size(meta, job)
    noise, _ = prepare_run(
        meta,
        height=height,
        width=width,
        num_steps=args.steps,
        seed=args.seed,
        config=config,
        num_frames=args.frames,
    )
    if args.parallel_vae or args.vae_chunk_rows:
        from tessera.diffusion.pipelines import check_vae_split

        check_vae_split(meta, noise, args.nproc if args.parallel_vae else 1, num_frames=args.frames)
    if video and (args.images_per_prompt or 1) > 1:
        raise ValueError(
            f"--images-per-prompt {args.images_per_prompt}: {type(meta).__name__} writes one video per run; drop it"
        )
    if args.fuse_lora and not args.lora:
        raise ValueError("--fuse-lora merges a LoRA into the weights: give the LoRA with --lora DIR")
    if args.lora:
        from tessera.diffusion.lora import check_lora

        check_lora(meta, args.lora)
    if args.nproc == 1:
        image = _pipeline_rank(str(args.model), job, config)
    else:
        image = spawn(_pipeline_rank, args.nproc, str(args.model), job, config, timeout_s=args.timeout)[0]
    partial = out.with_name(f".{out.name}.partial")
    if video:
        save_gif(image, partial)
        what = f"a {len(image)}-frame {image[0].width}x{image[0].height} video"
    elif isinstance(image, list):  # --images-per-prompt: the images side by side, one PNG
        row = side_by_side(image)
        row.save(partial, format="PNG")
        what = f"{len(image)} {image[0].width}x{image[0].height} images side by side"
    else:
        image.save(partial, format="PNG")
        what = f"a {image.width}x{image.height} image"
    partial.replace(out)
    print(f"wrote {what} ({config.describe()}, {args.nproc} process(es)) to {out}")


def side_by_side(images):
    """One PIL image holding ``images`` left to right (seeds seed, seed+1, ...)."""
    from PIL import Image

    row = Image.new("RGB", (sum(i.width for i in images), max(i.height for i in images)))
    x = 0
    for image in images:
        row.paste(image, (x, 0))
        x += image.width
    return row


def save_gif(frames, path, fps: int = 16) -> None:
    """An animated GIF of PIL frames, looping (Wan 2.1 makes 16 frames a second)."""
    frames[0].save(
        path, format="GIF", save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0
    )


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from tessera.diffusion.pipelines import is_pipeline_dir

    if is_pipeline_dir(args.model):
        return cmd_generate_pipeline(args)

    from tessera.data.digits import digit_classifier, parse_digits
    from tessera.diffusion.image_grid import check_writable, save_grid
    from tessera.runtime import spawn
    from tessera.train.checkpoint import load_dit

    digits = parse_digits(DEFAULT_DIGITS if args.digits is None else args.digits)
    refuse_other_conditioning(args, pipeline=False)
    per_digit = args.per_digit or DEFAULT_PER_DIGIT
    out = check_writable(args.out or DEFAULT_OUT)
    config = _layout(args)
    model = load_dit(args.model)  # fail here, before any process starts, if it is unusable
    _check_layout(model, config, args.steps)  # and if the layout does not fit it
    labels = torch.tensor(digits).repeat_interleave(per_digit)
    job = (str(args.model), labels, config, args.steps, args.guidance, args.seed)
    if args.nproc == 1:
        images = _generate_rank(*job, True)
    else:
        images = spawn(_generate_rank, args.nproc, *job, False, timeout_s=args.timeout)[0]
    # One column per requested digit: each column shows `per_digit` samples of it.
    grid = images.view(len(digits), per_digit, *images.shape[1:]).transpose(0, 1).flatten(0, 1)
    save_grid(grid, out, columns=len(digits), scale=8)
    print(f"wrote {len(images)} samples ({config.describe()}, {args.nproc} process(es)) to {out}")
    cfg = model.config
    if cfg.in_channels == 1 and cfg.image_size == 8 and cfg.num_classes == 10:
        clf = digit_classifier()
        accuracy = clf.accuracy(images, labels)
        print(
            f"class accuracy of the samples, by an independent classifier: {accuracy:.1%} "
            f"(n={len(images)}; the classifier scores {clf.held_out_accuracy:.1%} on held-out real digits)"
        )


def add_generate_parser(sub, positive_int) -> None:
    p = sub.add_parser(
        "generate", help="sample a Tessera checkpoint or a saved diffusers pipeline into a PNG"
    )
    p.add_argument("--model", required=True, help="Tessera checkpoint folder or diffusers pipeline folder")
    p.add_argument("--digits", help=f"classes to draw (Tessera DiT checkpoints; default {DEFAULT_DIGITS})")
    p.add_argument(
        "--per-digit",
        type=positive_int,
        help=f"samples per digit (Tessera DiT checkpoints; default {DEFAULT_PER_DIGIT})",
    )
    p.add_argument("--steps", type=positive_int, default=20, help="sampling steps")
    p.add_argument("--guidance", type=float, default=2.0, help="classifier-free guidance scale")
    p.add_argument("--prompt", help="text prompt (diffusers pipelines)")
    p.add_argument("--negative-prompt", default="", help="negative prompt (diffusers pipelines)")
    p.add_argument("--height", type=positive_int, help="image height in pixels (diffusers pipelines)")
    p.add_argument("--width", type=positive_int, help="image width in pixels (diffusers pipelines)")
    p.add_argument(
        "--frames",
        type=positive_int,
        help="video frames (video pipelines: Wan takes 4k+1 with its VAE's 4x time compression)",
    )
    p.add_argument(
        "--lora", help="a LoRA saved by diffusers/peft (folder or .safetensors) for the transformer"
    )
    p.add_argument("--fuse-lora", action="store_true", help="merge the --lora update into the weights")
    p.add_argument(
        "--images-per-prompt",
        type=positive_int,
        help="images of the prompt in one batch, seeds --seed, --seed+1, ... (written side by side)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", help=f"output PNG (default {DEFAULT_OUT}); a video: an animated .gif (default video.gif)"
    )
    p.add_argument(
        "--nproc", type=positive_int, default=1, help="local processes; the product of the degrees"
    )
    add_fields(p, LAYOUT)
    p.add_argument(
        "--parallel-vae",
        action="store_true",
        help="decode the image with the latent's rows split over every process (diffusers pipelines)",
    )
    p.add_argument(
        "--vae-chunk-rows",
        type=positive_int,
        help="run the VAE's convolutions over chunks of this many output rows: a lower memory peak",
    )
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds before a multi-process run is ended"
    )
    p.set_defaults(handler=cmd_generate)
