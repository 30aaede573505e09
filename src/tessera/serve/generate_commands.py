"""`tessera serve --task generate`: the flags only generation takes (the rank count, the
layout as `tessera generate` takes it, sizes and limits) and the handler. Light: no torch
until it runs."""

from __future__ import annotations

import argparse


def add_generate_flags(p: argparse.ArgumentParser, positive_int) -> None:
    from tessera.cli_flags import LAYOUT, add_fields

    g = p.add_argument_group("generation (--task generate)")
    g.add_argument("--nproc", type=positive_int, default=1, help="ranks held for the server's life")
    g.add_argument("--sizes", help="served sizes WIDTHxHEIGHT,... (pipelines; default: the model's own)")
    g.add_argument(
        "--max-steps", type=positive_int, default=100, help="most denoising steps a request may ask"
    )
    g.add_argument("--max-images", type=positive_int, default=4, help="most images per request (OpenAI's n)")
    g.add_argument("--max-batch-images", type=positive_int, default=8,
                   help="most images batched together (requests of one size, step count and guidance)")  # fmt: skip
    g.add_argument("--no-batching", action="store_true", help="one request per batch (the baseline)")
    g.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds before a request is given up (and its batch stopped); a request may ask less")  # fmt: skip
    g.add_argument("--max-restarts", type=positive_int, default=3,
                   help="failed restarts of the group in a row before /health says unhealthy")  # fmt: skip
    g.add_argument("--parallel-vae", action="store_true",
                   help="pipelines: decode with the latent's rows split over every rank")  # fmt: skip
    g.add_argument("--vae-chunk-rows", type=positive_int,
                   help="pipelines: the VAE's convolutions over chunks of this many output rows (a lower peak)")  # fmt: skip
    add_fields(p, LAYOUT)


def cmd_serve_generate(args: argparse.Namespace) -> None:
    from tessera.cli_generate import build_layout
    from tessera.serve.generate_server import GenerateServeConfig, run_generate_server
    from tessera.serve.generate_spec import Limits, parse_sizes

    limits = Limits(
        max_steps=args.max_steps,
        max_images=args.max_images,
        max_batch_images=args.max_batch_images,
        batching=not args.no_batching,
    )
    config = GenerateServeConfig(
        model=args.model, layout=build_layout(args), nproc=args.nproc, host=args.host, port=args.port,
        sizes=tuple(parse_sizes(args.sizes)) if args.sizes else (), limits=limits,
        max_queue=args.max_queue, request_timeout_s=args.request_timeout, payload_limit=args.payload_limit,
        threads=args.threads or 1, drain_timeout_s=args.drain_timeout_s, max_restarts=args.max_restarts,
        parallel_vae=args.parallel_vae, vae_chunk_rows=args.vae_chunk_rows,
    )  # fmt: skip
    if args.ray:
        from tessera.serve.generate_ray import run_generate_ray

        return run_generate_ray(config, replicas=args.replicas)
    if args.replicas != 1:
        raise ValueError(f"--replicas {args.replicas} needs --ray (one local server is one group of ranks)")
    from tessera.cli_flags import UserError
    from tessera.serve.generate_group import GroupError

    try:
        run_generate_server(config)
    except GroupError as exc:  # a rank could not load the model: say which and why, in one line
        raise UserError(f"the ranks could not start: {exc}") from None
