"""`tessera plan train | generate | memory`: rank the valid plans for a model on named hardware and
print the choice as the flags `tessera train` / `tessera generate` take."""

from __future__ import annotations

import argparse

# Light modules only (profiles and presets as data): the parsers are built on every command,
# so the planners load in the handlers.
from tessera.plan.devices import DEVICES, device_named
from tessera.plan.hardware import Hardware
from tessera.plan.model_spec import PRESETS, model_spec
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
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--efficiency", type=float, default=0.4, help="achieved fraction of the device's peak")
    p.add_argument(
        "--host-op-us",
        type=float,
        default=0.0,
        help="host microseconds per eager op: a layer takes at least its op count times this "
        "(tessera bench plan fits it on xDiT's FLUX table; 0: not modelled)",
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
        dtype=args.dtype,
        efficiency=args.efficiency,
        host_op_seconds=args.host_op_us * 1e-6,
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


def cmd_plan_generate(args) -> None:
    from tessera.plan.search import generate_flags, search_generate

    hw = _hardware(args)
    tokens = (args.height // 16) * (args.width // 16) if args.height and args.width else None
    spec = model_spec(args.model, tokens)
    ranked = search_generate(spec, args.devices, hw, steps=args.steps, guidance=not args.no_guidance)
    rows = [
        [
            i + 1,
            p.config.describe(),
            f"{p.seconds:.3f}",
            f"{p.memory_bytes_per_rank / GIB:.1f}",
            f"{p.comm_bytes / GIB:.2f}",
        ]
        for i, p in enumerate(ranked.fits[: args.top])
    ]
    print(
        f"{spec.name}: {spec.tokens} tokens, {args.steps} steps on {args.devices} x {hw.device.name} ({hw.link.name})"
    )
    print(_table(["rank", "plan", "seconds", "GiB/rank", "GiB moved"], rows))
    _check_fits(ranked, hw, args.devices)
    print(f"choice: tessera generate {generate_flags(ranked.fits[0].config)}")


def cmd_plan_train(args) -> None:
    from tessera.plan.search import search_train

    hw = _hardware(args)
    spec = model_spec(args.model, args.seq)
    ranked = search_train(
        spec,
        args.devices,
        hw,
        global_batch=args.global_batch,
        seq=spec.tokens,
        offload=args.offload,
        host_link_bandwidth=link_named(args.host_link).bandwidth,
    )
    rows = [
        [
            i + 1,
            p.candidate.describe(),
            f"{p.seconds:.3f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.memory_bytes_per_rank / GIB:.1f}",
        ]
        for i, p in enumerate(ranked.fits[: args.top])
    ]
    print(
        f"{spec.name}: {spec.total_params / 1e6:,.0f}M parameters, batch {args.global_batch} x {spec.tokens} tokens "
        f"on {args.devices} x {hw.device.name} ({hw.link.name})"
    )
    print(_table(["rank", "plan", "step s", "tokens/s", "GiB/rank"], rows))
    _check_fits(ranked, hw, args.devices)
    runnable = [p for p in ranked.fits if p.candidate.flags()]
    if ranked.fits[0].candidate.pp > 1:
        print(
            f"best predicted: {ranked.fits[0].candidate.describe()} (pipeline training is not in `tessera train` yet)"
        )
    if runnable:
        print(f"choice: tessera train {runnable[0].candidate.flags()}")


def add_plan_parsers(plan_sub) -> None:
    p = plan_sub.add_parser(
        "generate", help="rank the DiT inference plans (pipefusion, ulysses, ring, cfg, ...)"
    )
    add_hardware_args(p)
    p.add_argument("--height", type=int, help="image height in pixels (8x VAE, 2x2 patches)")
    p.add_argument("--width", type=int, help="image width in pixels")
    p.add_argument("--steps", type=int, default=20, help="sampling steps")
    p.add_argument("--no-guidance", action="store_true", help="no classifier-free guidance (Flux)")
    p.set_defaults(handler=cmd_plan_generate)
    p = plan_sub.add_parser("train", help="rank the training plans (dp, tp, ZeRO stage, checkpointing)")
    add_hardware_args(p)
    p.add_argument("--seq", type=int, default=1024, help="tokens per sample")
    p.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step")
    p.add_argument("--offload", action="store_true", help="also rank ZeRO-3 with static and planned offload")
    p.add_argument("--host-link", default="pcie4", help="link between a device and host memory (offload)")
    p.set_defaults(handler=cmd_plan_train)


def add_plan_memory_parser(plan_sub, positive_int) -> None:
    """`tessera plan memory`: the offload dry run (tessera.train.plan.gpt2_memory_report)."""
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
        p.add_argument(flag, type=positive_int, default=default, help=help_)
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
