"""`tessera plan train | generate | memory`: rank the valid plans for a model on named hardware and
print the choice as the flags `tessera train` / `tessera generate` take."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

# Light modules only (profiles and presets as data): the parsers are built on every command,
# so the planners load in the handlers.
from tessera.cli_flags import LAYOUT, PLAN, add_fields, add_renamed, as_flags, given, warn_renamed
from tessera.plan.devices import DEVICES, device_named
from tessera.plan.hardware import LINK_TOPOLOGY, Hardware
from tessera.plan.model_presets import PIPELINE_COUNTS, PRESETS
from tessera.plan.model_spec import model_spec
from tessera.plan.training_plan import OFFLOADS, PRECISIONS
from tessera.runtime.link import LINKS, link_named

GIB = 2**30


def add_hardware_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or a transformers model folder"
    )
    p.add_argument("--devices", type=int, required=True, help="devices (ranks) in all")
    p.add_argument("--device-profile", default="h100", help=f"one of {', '.join(DEVICES)}")
    p.add_argument("--link", default="nvlink4", help=f"link inside a node: one of {', '.join(LINKS)}")
    p.add_argument("--nodes", type=int, default=1, help="nodes the devices are spread over")
    p.add_argument("--inter-node-link", default="ib-hdr", help="link between nodes")
    p.add_argument(
        "--precision", default="bf16", choices=PRECISIONS, help="arithmetic precision (default bf16)"
    )
    add_renamed(p, "--dtype", "--precision")
    p.add_argument("--efficiency", type=float, default=0.4, help="achieved fraction of the device's peak")
    p.add_argument(
        "--host-op-us",
        type=float,
        default=0.0,
        help="host microseconds per eager op: a layer takes at least its op count times this "
        "(tessera bench plan fits it on xDiT's FLUX table; 0: not modelled)",
    )
    p.add_argument(
        "--pcie-group",
        type=int,
        default=0,
        help="GPUs behind one PCIe switch sharing its x16 uplink (a PCIe --link; 0: not modelled): "
        "all-to-alls leaving a switch share it",
    )
    p.add_argument("--top", type=int, default=10, help="rows of the table")


def _hardware(args) -> Hardware:
    if args.devices < 1 or args.nodes < 1 or args.devices % args.nodes:
        raise ValueError(f"--devices {args.devices} must be a positive multiple of --nodes {args.nodes}")
    return Hardware(
        device=device_named(args.device_profile),
        link=link_named(args.link),
        devices_per_node=args.devices // args.nodes,
        inter_node=link_named(args.inter_node_link) if args.nodes > 1 else None,
        precision=args.precision,
        efficiency=args.efficiency,
        host_op_seconds=args.host_op_us * 1e-6,
        pcie_group=args.pcie_group,
    )


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _check_fits(ranked, hw: Hardware, devices: int) -> None:
    budget = hw.device.memory_bytes / GIB
    if ranked.dropped:
        print(f"{len(ranked.dropped)} plan(s) dropped: over {budget:.0f} GiB per device")
    if not ranked.fits:
        raise ValueError(f"no plan fits {budget:.0f} GiB per device on {devices} devices")


# `tessera generate --model` for a preset: the planner knows the model's shape, but there is
# no folder of it here. (placeholder, what to put in its place, the image side in pixels the
# preset's tokens stand for; None: a Tessera DiT samples at its checkpoint's own size.)
PRESET_MODELS = {
    "bench-dit": (
        "<DIT_CHECKPOINT>",
        "a Tessera DiT checkpoint folder (tessera train --recipe digits-dit --out DIR writes one; "
        "it samples at its own image size)",
        None,
    ),
    "pixart-alpha": ("<PIPELINE_DIR>", "the folder of a saved diffusers PixArt-alpha pipeline", 1024),
    "flux-dev": ("<PIPELINE_DIR>", "the folder of a saved diffusers FLUX.1-dev pipeline", 1024),
}
RUNNABLE = "tessera generate samples PixArt, SD3 and Flux pipeline folders and Tessera DiT checkpoints"
PROMPT_PLACEHOLDER = "<your prompt>"


def _pipeline_pixels(folder: Path) -> tuple[int, int]:
    """The image size `tessera generate` samples a pipeline folder at by default (its
    transformer's sample size, Flux's 128 latents, times the VAE's downscale factor)."""
    configs = [folder / part / "config.json" for part in ("transformer", "vae")]
    for path in configs:
        if not path.is_file():
            raise ValueError(f"{folder}: a diffusers pipeline folder needs {path.relative_to(folder)}")
    transformer, vae = (json.loads(path.read_text()) for path in configs)
    side = transformer.get("sample_size", 128) * 2 ** (len(vae["block_out_channels"]) - 1)
    return side, side


def generate_command(args, best, video=None) -> tuple[list[str], str | None]:
    """The argv (after `tessera`) that samples ``args.model`` under the layout ``best`` with the
    planned steps, image size and guidance (and a video's ``--frames``: ``video``, the
    planned tessera.plan.video.VideoShape), and a one-line note where ``--model`` is a
    placeholder (a preset has no folder here; a model tessera generate cannot sample)."""
    size = (args.height, args.width) if args.height else None
    note = None
    if video is not None:
        model, text, size = args.model, True, (video.height, video.width)
    elif (Path(args.model) / "model_index.json").is_file():
        model, text = args.model, True
        size = size or _pipeline_pixels(Path(args.model))
    elif args.model in PRESET_MODELS:
        model, folder, pixels = PRESET_MODELS[args.model]
        text = pixels is not None
        size = (size or (pixels, pixels)) if text else None
        note = f"{args.model} is a planner preset with no folder here: put {folder} in place of {model}"
    else:
        model, text = "<PIPELINE_DIR>", True
        kind = "a planner preset" if args.model in PRESETS else "not a diffusers pipeline folder"
        note = f"{args.model} is {kind}; {RUNNABLE}: put one of those in place of {model}"
    argv = ["generate", "--model", model]
    if text:
        argv += ["--prompt", PROMPT_PLACEHOLDER]
    if size:
        argv += ["--height", str(size[0]), "--width", str(size[1])]
    if video is not None:
        argv += ["--frames", str(video.frames)]
    argv += ["--steps", str(args.steps)]
    if args.no_guidance:
        argv += ["--guidance", "1"]  # tessera generate runs the guidance branch only above 1
    argv += ["--nproc", str(best.world_size), *shlex.split(as_flags(best, LAYOUT))]
    return argv, note


def _seconds(s: float) -> str:
    """Three decimals, or three significant digits below 10 ms (a tiny model's run is not 0 s)."""
    return f"{s:.3f}" if s >= 0.01 else f"{s:.3g}"


def cmd_plan_generate(args) -> None:
    from tessera.plan.search import search_generate
    from tessera.plan.video import is_video_folder, video_plan

    hw = _hardware(args)
    if (args.height is None) != (args.width is None):
        only = f"--height {args.height}" if args.width is None else f"--width {args.width}"
        raise ValueError(f"only {only}: give --height and --width together (pixels), or neither")
    video = None
    if is_video_folder(args.model):
        video = video_plan(args.model, frames=args.frames, height=args.height, width=args.width)
        spec = video.spec
    elif args.frames is not None:
        raise ValueError(
            f"--frames {args.frames}: {args.model} is not a video pipeline folder; --frames plans a saved "
            "WanPipeline or LTXPipeline"
        )
    else:
        tokens = (args.height // 16) * (args.width // 16) if args.height else None
        spec = model_spec(args.model, tokens)
    ranked = search_generate(
        spec,
        args.devices,
        hw,
        steps=args.steps,
        guidance=not args.no_guidance,
        runnable=video.runnable if video else None,
    )
    rows = [
        [
            i + 1,
            p.config.describe(),
            _seconds(p.seconds),
            f"{p.memory_bytes_per_rank / GIB:.1f}",
            f"{p.comm_bytes / GIB:.2f}",
        ]
        for i, p in enumerate(ranked.fits[: args.top])
    ]
    what = video.shape.describe() if video else f"{spec.tokens} tokens"
    print(f"{spec.name}: {what}, {args.steps} steps on {args.devices} x {hw.device.name} ({hw.link.name})")
    if args.model in PIPELINE_COUNTS:
        counts = PIPELINE_COUNTS[args.model]
        print(f"counts: {counts['counted']}; not counted: {counts['not counted']}")
    if hw.link.name in LINK_TOPOLOGY:
        topology, source = LINK_TOPOLOGY[hw.link.name]
        shared = f"; {hw.pcie_group} GPUs per PCIe switch" if hw.pcie_group else ""
        print(f"link: {hw.link.name}: {topology}{shared} ({source})")
    print(_table(["rank", "plan", "seconds", "GiB/rank", "GiB moved"], rows))
    _check_fits(ranked, hw, args.devices)
    best = ranked.fits[0].config
    argv, note = generate_command(args, best, video.shape if video else None)
    print("choice: tessera " + shlex.join(argv))
    if note:
        print(f"note: {note}")


def cmd_plan_train(args) -> None:
    from tessera.plan.search import search_train
    from tessera.plan.training import describe

    hw = _hardware(args)
    spec = model_spec(args.model, args.seq)
    ranked = search_train(
        spec,
        args.devices,
        hw,
        global_batch=args.batch_size,
        seq=spec.tokens,
        offload=tuple(dict.fromkeys(args.offload or ())),
        host_link_bandwidth=link_named(args.host_link).bandwidth,
    )
    rows = [
        [
            i + 1,
            describe(p.plan),
            f"{p.seconds:.3f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.memory_bytes_per_rank / GIB:.1f}",
        ]
        for i, p in enumerate(ranked.fits[: args.top])
    ]
    print(
        f"{spec.name}: {spec.total_params / 1e6:,.0f}M parameters, batch {args.batch_size} x {spec.tokens} tokens "
        f"on {args.devices} x {hw.device.name} ({hw.link.name})"
    )
    print(_table(["rank", "plan", "step s", "tokens/s", "GiB/rank"], rows))
    _check_fits(ranked, hw, args.devices)
    best = ranked.fits[0].plan
    # gpt2-text is the recipe that takes every Plan setting; it trains its own small GPT-2, so
    # the plan for the model asked about is also given as the Plan a user's loop passes to boost
    if best.ep == 1:
        print(
            f"choice: tessera train --recipe gpt2-text --nproc {best.world_size} {as_flags(best, PLAN)}".rstrip()
        )
    else:  # no recipe trains a mixture of experts: the plan is for the user's own loop
        print(
            f"choice: {describe(best)} (expert parallel: no recipe trains a mixture of experts; boost your model)"
        )
    print(f"in Python: boost(model, optimizer, {plan_expression(best)})  (docs/training.md)")


def plan_expression(plan) -> str:
    """``plan`` as the constructor call that makes it: ``Plan(dp=2, zero=3)``."""
    import dataclasses

    def needed(f) -> bool:  # dropping it would change the plan (a resolved default does not)
        try:
            return dataclasses.replace(plan, **{f.name: f.default}) != plan
        except ValueError:
            return True

    changed = [
        f"{f.name}={getattr(plan, f.name)!r}" for f in dataclasses.fields(plan) if f.init and needed(f)
    ]
    return f"Plan({', '.join(changed)})"


class _OffloadPolicies(argparse.Action):
    """``--offload POLICY``, repeatable; a bare ``--offload`` (the old switch) means both."""

    def __call__(self, parser, namespace, values, option_string=None):
        policies = list(getattr(namespace, self.dest) or [])
        if values is None:
            warn_renamed("--offload without a policy", "--offload static --offload auto")
            values = ["static", "auto"]
        setattr(namespace, self.dest, policies + ([values] if isinstance(values, str) else values))


def add_plan_parsers(plan_sub) -> None:
    p = plan_sub.add_parser(
        "generate", help="rank the DiT inference plans (pipefusion, ulysses, ring, cfg, ...)"
    )
    add_hardware_args(p)
    p.add_argument("--height", type=int, help="image height in pixels (8x VAE, 2x2 patches)")
    p.add_argument("--width", type=int, help="image width in pixels")
    p.add_argument(
        "--frames",
        type=int,
        help="video frames (a saved WanPipeline / LTXPipeline folder; default: the pipeline's own): "
        "the VAE's temporal compression k takes k*n+1",
    )
    p.add_argument("--steps", type=int, default=20, help="sampling steps")
    p.add_argument("--no-guidance", action="store_true", help="no classifier-free guidance (Flux)")
    p.set_defaults(handler=cmd_plan_generate)
    p = plan_sub.add_parser("train", help="rank the training plans (dp, tp, ZeRO stage, checkpointing)")
    add_hardware_args(p)
    p.add_argument("--seq", type=int, default=1024, help="tokens per sample")
    p.add_argument("--batch-size", type=int, default=8, help="samples per optimizer step over all ranks")
    add_renamed(p, "--global-batch", "--batch-size")
    p.add_argument(
        "--offload",
        action=_OffloadPolicies,
        nargs="?",
        choices=[o for o in OFFLOADS if o is not None],
        help="also rank ZeRO-3 under this offload policy (repeatable: --offload static --offload auto)",
    )
    p.add_argument("--host-link", default="pcie4", help="link between a device and host memory (offload)")
    p.set_defaults(handler=cmd_plan_train)


MEMORY_PLAN_FIELDS = (
    "dp", "chunk_mib", "block_chunks", "offload", "device_memory", "host_memory", "offload_dir", "max_grad_norm",
)  # fmt: skip


def add_plan_memory_parser(plan_sub, positive_int) -> None:
    """`tessera plan memory`: the offload dry run (tessera.train.plan.gpt2_memory_report)."""
    p = plan_sub.add_parser("memory", help="dry run of an offloaded GPT-2: bytes per tier, moved, peak")
    for flag_, default, help_ in (
        ("--layers", 12, "transformer blocks"),
        ("--hidden-size", 768, "hidden size"),
        ("--heads", 12, "attention heads"),
        ("--vocab", 50257, "vocabulary"),
        ("--seq", 1024, "tokens per sequence"),
    ):
        p.add_argument(flag_, type=positive_int, default=default, help=help_)
    add_renamed(p, "--width", "--hidden-size")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        help="samples per optimizer step over all ranks (default: one per rank)",
    )
    p.add_argument(
        "--batch", type=positive_int, dest="batch_per_rank", action=_RenamedBatch, help=argparse.SUPPRESS
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="compute device (default: cuda if present)")
    add_fields(p, PLAN, only=MEMORY_PLAN_FIELDS, defaults={"offload": "auto"})
    p.set_defaults(handler=cmd_plan_memory)


class _RenamedBatch(argparse.Action):
    """The old ``plan memory --batch N``: N sequences per rank (``--batch-size`` counts all ranks)."""

    def __call__(self, parser, namespace, values, option_string=None):
        warn_renamed("--batch N (per rank)", "--batch-size N x dp (over all ranks)")
        setattr(namespace, self.dest, values)


def cmd_plan_memory(args: argparse.Namespace) -> None:
    import tessera
    from tessera.train.plan import gpt2_memory_report

    plan = tessera.Plan(zero=3, **given(args, PLAN))
    if args.batch_per_rank is not None:
        per_rank = args.batch_per_rank
    elif args.batch_size is None:
        per_rank = 1
    elif args.batch_size % plan.dp:
        raise ValueError(
            f"--batch-size {args.batch_size} does not split over --dp {plan.dp}: use a multiple of {plan.dp}"
        )
    else:
        per_rank = args.batch_size // plan.dp
    report = gpt2_memory_report(
        layers=args.layers, width=args.hidden_size, heads=args.heads, vocab=args.vocab, seq=args.seq,
        batch=per_rank, plan=plan, device=args.device,
    )  # fmt: skip
    print(report.text())
