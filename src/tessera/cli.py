"""`tessera train | generate | launch`: the command line.

A user's mistake (bad flag value, missing or corrupt checkpoint, unwritable output)
ends in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

EXIT_USAGE = 2


class UserError(Exception):
    """Raised by command handlers for conditions the user can fix."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# ---- train -------------------------------------------------------------------------------


def _train_rank(recipe, out_dir: str, resume: bool) -> dict:
    from tessera.runtime import Mesh
    from tessera.train.digits_dit import train

    return train(recipe, Mesh(dp=_world()), out_dir, resume=resume)


def _world() -> int:
    from tessera.runtime.mesh import world_size

    return world_size()


def cmd_train(args: argparse.Namespace) -> None:
    from tessera.runtime import spawn
    from tessera.train import checkpoint as ckpt
    from tessera.train import gpt2_text
    from tessera.train.digits_dit import RECIPE_NAME, DigitsDiTRecipe

    if args.recipe == gpt2_text.RECIPE_NAME:
        return _train_with_plan(args)
    if args.recipe == "rocbert-sentiment":
        from tessera.apps.rocbert.commands import train_command

        return print(train_command(args))
    if args.recipe != RECIPE_NAME:
        raise UserError(
            f"unknown recipe {args.recipe!r}; available: {RECIPE_NAME}, {gpt2_text.RECIPE_NAME}, rocbert-sentiment"
        )
    plan_flags = (
        args.dp,
        args.tp,
        args.zero,
        args.grad_accum,
        args.max_grad_norm,
        args.precision,
        args.activation_checkpointing,
        args.block_chunks,
        args.chunk_mib,
    )
    if plan_flags != (None, 1, 0, 1, None, "fp32", False, False, None):
        raise UserError(
            f"recipe {RECIPE_NAME} trains data parallel over --nproc only; --dp/--tp/--zero/--grad-accum/"
            f"--max-grad-norm/--precision/--activation-checkpointing/--block-chunks/--chunk-mib apply to "
            f"{gpt2_text.RECIPE_NAME}"
        )
    overrides = {
        k: v
        for k, v in (("steps", args.steps), ("seed", args.seed), ("batch_size", args.batch_size))
        if v is not None
    }
    recipe = DigitsDiTRecipe(**overrides)
    if recipe.batch_size % args.nproc:
        raise UserError(f"batch size {recipe.batch_size} is not divisible by --nproc {args.nproc}")
    out = Path(args.out)
    if args.resume:
        step = ckpt.read_train_meta(out)["step"]
        if step >= recipe.steps:
            print(f"{out} is already trained to step {step} (of {recipe.steps}); nothing to do")
            return
    elif (out / "config.json").exists():
        raise UserError(
            f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out"
        )
    began = time.perf_counter()
    if args.nproc == 1:
        summary = _train_rank(recipe, str(out), args.resume)
    else:
        summary = spawn(_train_rank, args.nproc, recipe, str(out), args.resume, timeout_s=args.timeout)[0]
    print(
        f"trained {summary['steps_run']} steps on {args.nproc} process(es) in "
        f"{time.perf_counter() - began:.1f}s (loop {summary['seconds']:.1f}s); "
        f"final loss {summary['final_loss']:.4f}; checkpoint: {out}"
    )


def _train_with_plan(args: argparse.Namespace) -> None:
    import tessera
    from tessera.bench.harness import matmul_peak_flops
    from tessera.runtime import spawn
    from tessera.train import gpt2_text

    if args.dp is None and args.nproc % args.tp:
        raise UserError(
            f"--nproc {args.nproc} is not a multiple of --tp {args.tp}: dp x tp must equal the processes"
        )
    dp = args.dp if args.dp is not None else args.nproc // args.tp
    try:
        plan = tessera.Plan(
            dp=dp,
            tp=args.tp,
            zero=args.zero,
            precision=args.precision,
            grad_accum=args.grad_accum,
            max_grad_norm=args.max_grad_norm,
            activation_checkpointing=args.activation_checkpointing,
            block_chunks=args.block_chunks,
            **({"chunk_mib": args.chunk_mib} if args.chunk_mib is not None else {}),
        )
        plan.check_world(args.nproc)
        overrides = {
            k: v
            for k, v in (("steps", args.steps), ("seed", args.seed), ("batch_size", args.batch_size))
            if v is not None
        }
        recipe = gpt2_text.GPT2TextRecipe(**overrides)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if recipe.batch_size % (plan.dp * plan.grad_accum):
        raise UserError(
            f"batch size {recipe.batch_size} does not split into dp={plan.dp} x grad_accum={plan.grad_accum}"
        )
    out = Path(args.out)
    if not args.resume and (out / "checkpoint").exists():
        raise UserError(
            f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out"
        )
    peak = matmul_peak_flops()
    began = time.perf_counter()
    call = (recipe, plan, str(out), args.resume, peak)
    if args.nproc == 1:
        summary = gpt2_text.train_rank(*call)
    else:
        summary = spawn(gpt2_text.train_rank, args.nproc, *call, timeout_s=args.timeout)[0]
    last = summary["log"][-1] if summary["log"] else {}
    skipped = f"; {last['skipped_steps']} fp16 steps skipped" if "skipped_steps" in last else ""
    print(
        f"trained {summary['steps_run']} steps of {gpt2_text.RECIPE_NAME} with dp={plan.dp} tp={plan.tp} "
        f"zero={plan.zero} in {time.perf_counter() - began:.1f}s; final loss {summary['final_loss']}{skipped}; "
        f"{last.get('tokens_per_s', 0):.0f} tokens/s, MFU {last.get('mfu', 0):.1%}, peak RSS {last.get('peak_rss_mib', 0):.0f} MiB (rank 0); "
        f"checkpoint: {out / 'checkpoint'}, HuggingFace export: {out / 'hf'}"
    )


# ---- generate ----------------------------------------------------------------------------


def _layout(args: argparse.Namespace):
    from tessera.diffusion.layout import ParallelConfig

    config = ParallelConfig(
        pipefusion_degree=args.pipefusion,
        num_patches=args.patches,
        warmup_steps=args.warmup_steps,
        ulysses_degree=args.ulysses,
        ring_degree=args.ring,
        cfg_parallel=args.cfg_parallel,
        tp_degree=args.tp,
        distrifusion_degree=args.distrifusion,
    )
    if config.world_size != args.nproc:
        raise UserError(
            f"parallel layout {config.describe()} needs {config.world_size} processes but --nproc is {args.nproc}"
        )
    return config


def _generate_rank(model_dir: str, labels, config, steps: int, guidance: float, seed: int, progress: bool):
    from tessera.diffusion.parallel import parallel_sample
    from tessera.diffusion.pipefusion import release_other_stages
    from tessera.train.checkpoint import load_dit

    model = load_dit(model_dir)
    size = model.config.image_size
    mesh = config.build_mesh()
    if config.method == "pipefusion" and config.pipefusion_degree > 1:
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


def _pipeline_rank(model_dir: str, args: dict, config):
    from tessera.diffusion.pipelines import generate, load_pipeline
    from tessera.runtime.mesh import global_rank

    pipe = load_pipeline(model_dir, with_text_encoder=global_rank() == 0)
    pipe.set_progress_bar_config(disable=True)
    if not (args["height"] and args["width"]):  # the pipeline's own default size
        latent = getattr(pipe, "default_sample_size", None) or pipe.transformer.config.sample_size
        args = {
            **args,
            "height": args["height"] or latent * pipe.vae_scale_factor,
            "width": args["width"] or latent * pipe.vae_scale_factor,
        }
    height, width = args["height"], args["width"]
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
    )
    return image


def cmd_generate_pipeline(args: argparse.Namespace) -> None:
    from tessera.diffusion.image_grid import check_writable
    from tessera.runtime import spawn

    if not args.prompt:
        raise UserError(f"{args.model} is a diffusers pipeline: give a --prompt")
    out = check_writable(args.out)
    config = _layout(args)
    job = {
        k: getattr(args, k)
        for k in ("prompt", "negative_prompt", "height", "width", "steps", "guidance", "seed")
    }
    if args.nproc == 1:
        image = _pipeline_rank(str(args.model), job, config)
    else:
        image = spawn(_pipeline_rank, args.nproc, str(args.model), job, config, timeout_s=args.timeout)[0]
    partial = out.with_name(f".{out.name}.partial")
    image.save(partial, format="PNG")
    partial.replace(out)
    print(
        f"wrote a {image.width}x{image.height} image ({config.describe()}, {args.nproc} process(es)) to {out}"
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

    digits = parse_digits(args.digits)
    out = check_writable(args.out)
    config = _layout(args)
    model = load_dit(args.model)  # fail here, before any process starts, if it is unusable
    labels = torch.tensor(digits).repeat_interleave(args.per_digit)
    job = (str(args.model), labels, config, args.steps, args.guidance, args.seed)
    if args.nproc == 1:
        images = _generate_rank(*job, True)
    else:
        images = spawn(_generate_rank, args.nproc, *job, False, timeout_s=args.timeout)[0]
    # One column per requested digit: each column shows `per_digit` samples of it.
    grid = images.view(len(digits), args.per_digit, *images.shape[1:]).transpose(0, 1).flatten(0, 1)
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


# ---- bench -------------------------------------------------------------------------------


# `tessera bench NAME`: the module under tessera.bench, its run and plot functions. Each
# run takes quick=...; dit and kernels take their plan (built in cmd_bench).
BENCHES = {
    name: (name, f"run_{name}_bench", f"plot_{name}")
    for name in (
        "dap",
        "train",
        "offload",
        "autochunk",
        "pipeline",
        "plan",
        "fdia",
        "serve",
        "robust",
        "machine",
    )
} | {"dit": ("dit", "run_dit_bench", "plot_dit"), "kernels": ("kernels", "run_kernels_bench", "plot_kernels")}


def _dit_bench(args: argparse.Namespace):
    import dataclasses

    from tessera.bench.dit import FULL, QUICK, run_dit_bench

    digits = Path(args.digits_model)
    plan = QUICK if args.quick else FULL
    if args.link is not None:
        plan = dataclasses.replace(plan, links=tuple(n for n in args.link if n != "none"))
    if args.link_device is not None:
        plan = dataclasses.replace(plan, link_device=args.link_device)
    return run_dit_bench(plan, digits if (digits / "config.json").exists() else None)


def cmd_bench(args: argparse.Namespace) -> None:
    import importlib

    from tessera.bench.harness import write_results

    if args.name not in BENCHES:
        raise UserError(f"unknown benchmark {args.name!r}; available: {', '.join(sorted(BENCHES))}")
    module_name, run_name, plot_name = BENCHES[args.name]
    module = importlib.import_module(f"tessera.bench.{module_name}")
    if args.name == "dit":
        result = _dit_bench(args)
    elif args.name == "kernels":
        result = module.run_kernels_bench(module.QUICK if args.quick else module.FULL)
    else:
        result = getattr(module, run_name)(quick=args.quick)
    paths = write_results(result, args.out, getattr(module, plot_name))
    print("headline: " + ", ".join(f"{k}={v}" for k, v in result.headline.items()))
    print("wrote " + ", ".join(str(p) for p in paths))


# ---- fdia --------------------------------------------------------------------------------


def cmd_fdia(args: argparse.Namespace) -> None:
    from tessera.apps.sil_fdia import commands

    if args.fdia_command == "bench":
        args.name = "fdia"
        return cmd_bench(args)
    run = commands.simulate_command if args.fdia_command == "simulate" else commands.detect_command
    print(run(args))


def _add_fdia_parser(sub) -> None:
    p = sub.add_parser(
        "fdia", help="false data injection on solar insecticidal lamps: simulate | detect | bench"
    )
    fdia = p.add_subparsers(dest="fdia_command", required=True)
    for name, text in (
        (
            "simulate",
            "simulate a deployment (optionally attacked): CSV, telemetry plot, a WAV clip and its spectrogram",
        ),
        (
            "detect",
            "score an attack with the telemetry, sound and fused detectors, or count zaps in --audio FILE.wav",
        ),
    ):
        q = fdia.add_parser(name, help=text)
        q.add_argument("--lamps", type=_positive_int, default=4)
        q.add_argument("--seed", type=int, default=0)
        q.add_argument(
            "--attack", help="scale, additive, replay, constant, zero, daytime, battery or stealthy"
        )
        q.add_argument("--start-h", type=float, default=80.0, help="attack start, hours after noon of day 0")
        q.add_argument("--end-h", type=float, default=86.0, help="attack end, hours after noon of day 0")
        q.add_argument("--targets", default="0", help="attacked lamp ids, e.g. 0,2")
        q.add_argument(
            "--magnitude", type=float, help="factor / offset / days back / value (default per kind)"
        )
        q.add_argument("--snr-db", type=float, default=15.0, help="a median zap against the background")
        q.add_argument("--out", default="runs/fdia", help="folder for the CSV, WAV and plots")
        if name == "simulate":
            q.add_argument("--days", type=_positive_int, default=4)
            q.add_argument("--audio-seconds", type=float, default=30.0, help="length of the WAV clip")
        else:
            q.add_argument(
                "--listen-s", type=float, default=60.0, help="seconds recorded per 10-min night interval"
            )
            q.add_argument("--audio", help="a mono 16-bit 16 kHz WAV: count its zaps instead")
            q.add_argument("--plot", help="with --audio: write its spectrogram with the zaps marked here")
        q.set_defaults(handler=cmd_fdia)
    q = fdia.add_parser("bench", help="the same as `tessera bench fdia`")
    q.add_argument("--quick", action="store_true", help="small version, under two minutes on 2 cores")
    q.add_argument("--out", default="benchmarks/results", help="folder for fdia.json / .md / .png")
    q.set_defaults(handler=cmd_fdia)


# ---- robust (ROCBERT) --------------------------------------------------------------------


def cmd_robust(args: argparse.Namespace) -> None:
    from tessera.apps.rocbert.commands import attack_command

    print(attack_command(args))


def _add_robust_parser(sub) -> None:
    p = sub.add_parser("robust", help="ROCBERT robust Chinese classification: attack a trained model")
    robust = p.add_subparsers(dest="robust_command", required=True)
    q = robust.add_parser("attack", help="show synthetic attacks of --text and the model's predictions")
    q.add_argument("--model", required=True, help="folder from `tessera train --recipe rocbert-sentiment`")
    q.add_argument("--text", action="append", required=True, help="a Chinese text (repeatable)")
    q.add_argument("--variants", type=_positive_int, default=5, help="synthetic attacked copies per text")
    q.add_argument(
        "--query-budget", type=_positive_int, default=200, help="greedy black-box attack's queries"
    )
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(handler=cmd_robust)


# ---- serve -------------------------------------------------------------------------------

_SERVE_FIELDS = (
    "model", "task", "pooling", "host", "port", "scheduler", "runner", "attention", "memory_plan", "max_batch_tokens",
    "max_batch_size", "max_queue", "max_client_batch", "payload_limit", "overload_status", "threads",
    "drain_timeout_s", "cost_table",
)  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> None:
    from tessera.serve.server import ServeConfig, run_server

    config = ServeConfig(**{name: getattr(args, name) for name in _SERVE_FIELDS})
    if args.ray:
        from tessera.serve.ray_serve import run_ray

        return run_ray(config, replicas=args.replicas)
    if args.replicas != 1:
        raise UserError(f"--replicas {args.replicas} needs --ray (one local server is one engine)")
    run_server(config)


# ---- plan memory (offload dry run) -------------------------------------------------------


def _add_plan_memory(plan_sub) -> None:
    p = plan_sub.add_parser("memory", help="dry run of an offloaded GPT-2: bytes per tier, moved, peak")
    for flag, default, help_ in (
        ("--layers", 12, "transformer blocks"),
        ("--width", 768, "hidden size"),
        ("--heads", 12, "attention heads"),
        ("--vocab", 50257, "vocabulary"),
        ("--seq", 1024, "tokens per sequence"),
        ("--batch", 1, "sequences per rank and micro-batch"),
        ("--dp", 1, "data-parallel ranks (ZeRO-3 shards)"),
    ):
        p.add_argument(flag, type=_positive_int, default=default, help=help_)
    p.add_argument("--chunk-mib", type=float, default=32.0, help="chunk size")
    p.add_argument("--offload", default="auto", choices=["auto", "static"])
    p.add_argument("--device", choices=["cpu", "cuda"], help="compute device (default: cuda if present)")
    p.add_argument("--device-memory", help="model data on the GPU per rank, e.g. 8GiB")
    p.add_argument("--host-memory", help="model data in host memory per rank, e.g. 16GiB")
    p.add_argument("--offload-dir", help="directory for chunks on disk")
    p.add_argument("--max-grad-norm", type=float, help="clipping (one more pass over the gradients)")
    p.set_defaults(handler=cmd_plan_memory)


def cmd_plan_memory(args: argparse.Namespace) -> None:
    import tessera
    from tessera.train.plan import gpt2_memory_report, parse_bytes

    def size(text):
        return None if text is None else parse_bytes(text)

    plan = tessera.Plan(
        dp=args.dp, zero=3, chunk_mib=args.chunk_mib, offload=args.offload, max_grad_norm=args.max_grad_norm,
        device_memory=size(args.device_memory), host_memory=size(args.host_memory), offload_dir=args.offload_dir,
    )  # fmt: skip
    report = gpt2_memory_report(
        layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq,
        batch=args.batch, plan=plan, device=args.device,
    )  # fmt: skip
    print(report.text())


# ---- launch ------------------------------------------------------------------------------


def cmd_launch(args: argparse.Namespace, extra: list[str]) -> int:
    from tessera.runtime.launch import torchrun_command

    if not Path(args.script).is_file():
        raise UserError(f"script {args.script} does not exist")
    cmd = torchrun_command(args.nproc, args.script, args.script_args, extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", *cmd[1:]]
    return subprocess.call(cmd)


# ---- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a recipe with data parallel processes")
    p.add_argument("--recipe", required=True, help="recipe name (digits-dit, gpt2-text, rocbert-sentiment)")
    p.add_argument("--nproc", type=_positive_int, default=1, help="local processes (ranks)")
    p.add_argument("--out", default="runs/digits-dit", help="checkpoint folder")
    p.add_argument("--steps", type=_positive_int, help="total optimizer steps")
    p.add_argument("--batch-size", type=_positive_int, help="global batch size")
    p.add_argument("--seed", type=int)
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is ended")
    p.add_argument("--dp", type=_positive_int, help="data parallel degree (default: nproc / tp)")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel degree")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over dp")
    p.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches per step")
    p.add_argument("--max-grad-norm", type=float, help="clip the global gradient norm")
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="bf16: autocast, fp32 master; fp16: the same with dynamic loss scaling",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each transformer block's activations in backward instead of keeping them",
    )
    p.add_argument("--block-chunks", action="store_true", help="a new ZeRO chunk at every transformer block")
    p.add_argument("--chunk-mib", type=float, help="ZeRO chunk size in MiB (default 32)")
    p.set_defaults(handler=cmd_train)

    p = sub.add_parser(
        "generate", help="sample a Tessera checkpoint or a saved diffusers pipeline into a PNG"
    )
    p.add_argument("--model", required=True, help="Tessera checkpoint folder or diffusers pipeline folder")
    p.add_argument("--digits", default="0123456789", help="classes to draw, e.g. 0123456789")
    p.add_argument("--per-digit", type=_positive_int, default=10, help="samples per digit")
    p.add_argument("--steps", type=_positive_int, default=20, help="sampling steps")
    p.add_argument("--guidance", type=float, default=2.0, help="classifier-free guidance scale")
    p.add_argument("--prompt", help="text prompt (diffusers pipelines)")
    p.add_argument("--negative-prompt", default="", help="negative prompt (diffusers pipelines)")
    p.add_argument("--height", type=_positive_int, help="image height in pixels (diffusers pipelines)")
    p.add_argument("--width", type=_positive_int, help="image width in pixels (diffusers pipelines)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="grid.png", help="output PNG")
    p.add_argument(
        "--nproc", type=_positive_int, default=1, help="local processes; the product of the degrees"
    )
    p.add_argument("--pipefusion", type=_positive_int, default=1, help="PipeFusion degree (pipeline stages)")
    p.add_argument("--patches", type=_positive_int, help="PipeFusion patches along the height")
    p.add_argument("--warmup-steps", type=int, default=1, help="synchronous steps before stale K/V is used")
    p.add_argument(
        "--ulysses", type=_positive_int, default=1, help="Ulysses (all-to-all) sequence parallel degree"
    )
    p.add_argument("--ring", type=_positive_int, default=1, help="Ring attention sequence parallel degree")
    p.add_argument("--cfg-parallel", action="store_true", help="guidance branches on two ranks")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel degree (baseline)")
    p.add_argument("--distrifusion", type=_positive_int, default=1, help="DistriFusion degree (baseline)")
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds before a multi-process run is ended"
    )
    p.set_defaults(handler=cmd_generate)

    p = sub.add_parser("bench", help="run a benchmark (baseline and Tessera in one run)")
    p.add_argument("name", help="benchmark: " + ", ".join(sorted(BENCHES)))
    p.add_argument("--quick", action="store_true", help="small version, under two minutes on 2 cores")
    p.add_argument("--out", default="benchmarks/results", help="folder for NAME.json / .md / .png")
    p.add_argument(
        "--digits-model", default="runs/digits-dit", help="trained digits DiT for the fidelity table"
    )
    p.add_argument(
        "--link",
        action="append",
        help="dit: rerun the methods with transfers timed as on this link (repeatable; e.g. pcie4, nvlink4, "
        "ethernet-25g; 'none' for no link runs); default: pcie4 and ethernet-25g (quick: pcie4)",
    )
    p.add_argument(
        "--link-device", help="dit: the GPU whose compute-to-link balance the links keep (default l40)"
    )
    p.set_defaults(handler=cmd_bench)

    p = sub.add_parser("serve", help="serve a transformers encoder over HTTP (TEI- and OpenAI-compatible)")
    p.add_argument("--model", required=True, help="folder written by save_pretrained, tokenizer beside it")
    p.add_argument("--task", default="auto", choices=["auto", "embed", "classify"])
    p.add_argument("--pooling", default="mean", choices=["mean", "cls"], help="embeddings: token pooling")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port; 0 picks a free one (printed)")
    p.add_argument(
        "--scheduler",
        default="dp",
        choices=["dp", "fifo_padded", "sort_window", "one_by_one"],
        help="dp: TurboTransformers' DP over the length-sorted queue; the others are the baselines",
    )
    p.add_argument(
        "--runner", default="auto", choices=["auto", "unpadded", "padded"], help="auto: unpadded for dp"
    )
    p.add_argument("--attention", default="per_request", choices=["per_request", "padded", "nested"])
    p.add_argument(
        "--memory-plan", action="store_true", help="activations in planned chunks (needs --attention padded)"
    )
    p.add_argument("--max-batch-tokens", type=_positive_int, default=16384, help="longest x batch size")
    p.add_argument("--max-batch-size", type=_positive_int, default=32, help="inputs per batch")
    p.add_argument("--max-queue", type=_positive_int, default=512, help="waiting inputs before 429")
    p.add_argument("--max-client-batch", type=_positive_int, default=32, help="inputs per request")
    p.add_argument("--payload-limit", type=_positive_int, default=2_000_000, help="request body bytes")
    p.add_argument("--overload-status", type=int, default=429, choices=[429, 503], help="full-queue status")
    p.add_argument("--threads", type=_positive_int, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--drain-timeout",
        dest="drain_timeout_s",
        type=float,
        default=30.0,
        help="seconds to drain on SIGTERM",
    )
    p.add_argument(
        "--cost-table", help="JSON file: the DP's cost table, loaded if present, else measured and saved"
    )
    p.add_argument("--ray", action="store_true", help="serve through Ray Serve replicas of the engine")
    p.add_argument("--replicas", type=_positive_int, default=1, help="Ray Serve replicas (with --ray)")
    p.set_defaults(handler=cmd_serve)

    p = sub.add_parser("plan", help="choose a parallel plan by cost model and simulation")
    plan_sub = p.add_subparsers(dest="plan_command", required=True)
    from tessera.plan.commands import add_plan_parsers  # light: no torch model is built

    add_plan_parsers(plan_sub)  # `plan train`, `plan generate`; `plan memory` (offload) joins here
    _add_plan_memory(plan_sub)

    _add_fdia_parser(sub)
    _add_robust_parser(sub)

    p = sub.add_parser("launch", help="run a script under torchrun (other flags pass through to torchrun)")
    p.add_argument("-n", "--nproc", type=_positive_int, required=True, help="processes per node")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(handler=cmd_launch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from tessera.runtime.launch import RankError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "launch":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    handler: Callable = args.handler
    try:
        result = handler(args, extra) if args.command == "launch" else handler(args)
    except (UserError, ValueError, FileNotFoundError, PermissionError) as exc:
        print(f"tessera: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RankError as exc:
        print(f"tessera: error: rank {exc.rank} failed: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tessera: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
