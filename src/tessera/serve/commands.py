"""`tessera serve`: its command-line flags and handler (the server is tessera.serve.server)."""

from __future__ import annotations

import argparse

_SERVE_FIELDS = (
    "model", "task", "pooling", "host", "port", "scheduler", "runner", "attention", "memory_plan", "kernels",
    "amx", "tuning", "max_batch_tokens", "max_batch_size", "max_queue", "max_client_batch", "payload_limit",
    "overload_status", "threads", "workers", "drain_timeout_s", "cost_table",
)  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> None:
    from tessera.cli_flags import UserError

    if args.make_example_model:
        if args.model:
            raise UserError(
                f"--model {args.model} and --make-example-model {args.make_example_model}: give one "
                "(write an example encoder folder, then serve it with --model)"
            )
        return make_example_model(args.make_example_model)
    if not args.model:
        raise UserError(
            "give --model DIR: a folder written by save_pretrained with its tokenizer "
            "(tessera serve --make-example-model DIR writes one to try)"
        )
    generating = args.task == "generate" or (args.task == "auto" and _is_generation_model(args.model))
    _refuse_other_task(args, generating)
    if generating:
        from tessera.serve.generate_commands import cmd_serve_generate

        return cmd_serve_generate(args)
    from tessera.serve.server import ServeConfig, run_server

    config = ServeConfig(**{name: getattr(args, name) for name in _SERVE_FIELDS})
    if args.ray:
        from tessera.serve.ray_serve import run_ray

        return run_ray(config, replicas=args.replicas)
    if args.replicas != 1:
        raise ValueError(f"--replicas {args.replicas} needs --ray (one local server is one engine)")
    run_server(config)


# flags (by dest) that only one task reads; given to the other they would be ignored
ENCODER_ONLY = (
    "pooling", "scheduler", "runner", "attention", "memory_plan", "kernels", "amx", "tuning", "max_batch_tokens",
    "max_batch_size", "max_client_batch", "overload_status", "cost_table", "workers",
)  # fmt: skip
GENERATE_ONLY = (
    "nproc", "sizes", "max_steps", "max_images", "max_batch_images", "no_batching", "request_timeout",
    "max_restarts", "parallel_vae", "vae_chunk_rows",
)  # fmt: skip


def _refuse_other_task(args: argparse.Namespace, generating: bool) -> None:
    """A flag the chosen task does not read is refused in one line, never ignored."""
    from tessera.cli_flags import LAYOUT, UserError, flag

    parser = args.serve_parser
    if generating:
        other, task = ENCODER_ONLY, "encoders (--task embed or classify)"
    else:
        other = GENERATE_ONLY + tuple(f.name for f in LAYOUT.fields())
        task = "generation (--task generate)"
    given = [flag(name) for name in other if getattr(args, name, None) != parser.get_default(name)]
    if given:
        serving = "generation" if generating else "an encoder"
        raise UserError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} read by {task} only, "
            f"and --model {args.model} is served as {serving}: drop {'it' if len(given) == 1 else 'them'}"
        )


def _is_generation_model(directory: str) -> bool:
    """A diffusers pipeline folder or a Tessera DiT checkpoint (served by --task generate)."""
    import json
    from pathlib import Path

    folder = Path(directory)
    if (folder / "model_index.json").is_file():
        return True
    try:
        return json.loads((folder / "config.json").read_text()).get("format") == "tessera-dit"
    except (OSError, ValueError, AttributeError):
        return False


def make_example_model(directory: str) -> None:
    from tessera.serve.synthetic import save_example_encoder

    path = save_example_encoder(directory)
    print(
        f"wrote an example encoder to {path} (BERT, random weights, an English WordPiece tokenizer); "
        f"serve it with: tessera serve --model {path}"
    )


def _workers(positive_int):
    def parse(text: str):
        return "auto" if text == "auto" else positive_int(text)

    return parse


def add_serve_parser(sub, positive_int) -> None:
    from tessera.serve.scheduler import NAMES as SCHEDULER_NAMES  # no torch, no numpy

    p = sub.add_parser(
        "serve",
        help="serve a transformers encoder (TEI- and OpenAI-compatible) or a DiT's image generation over HTTP",
    )
    p.add_argument(
        "--model",
        help="folder written by save_pretrained, tokenizer beside it; or (--task generate) a Tessera DiT "
        "checkpoint or a saved diffusers pipeline",
    )
    p.add_argument(
        "--make-example-model",
        metavar="DIR",
        help="write a small example encoder folder to DIR (random weights, an English tokenizer) and exit",
    )
    p.add_argument(
        "--task",
        default="auto",
        choices=["auto", "embed", "classify", "generate"],
        help="generate: image generation over a group of --nproc ranks (auto picks it for a DiT checkpoint "
        "or a diffusers pipeline folder)",
    )
    p.add_argument("--pooling", default="mean", choices=["mean", "cls"], help="embeddings: token pooling")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port; 0 picks a free one (printed)")
    p.add_argument(
        "--scheduler",
        default="dp",
        choices=list(SCHEDULER_NAMES),
        help="dp: TurboTransformers' DP over the length-sorted queue; the others are the baselines",
    )
    p.add_argument(
        "--runner", default="auto", choices=["auto", "unpadded", "padded"], help="auto: unpadded for dp"
    )
    p.add_argument("--attention", default="per_request", choices=["per_request", "padded", "nested"])
    p.add_argument(
        "--memory-plan", action="store_true", help="activations in planned chunks (needs --attention padded)"
    )
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "tessera", "torch"],
        help="dense layers of the unpadded runner: Tessera's compiled kernels or torch's "
        "(auto: tessera when a C compiler is found and no --memory-plan)",
    )
    p.add_argument(
        "--amx",
        default="auto",
        choices=["auto", "off"],
        help="Tessera's dense kernels on AMX tiles where the CPU has AMX-BF16 (float32 accuracy from six "
        "bfloat16 products a product; auto), or on AVX only (off)",
    )
    p.add_argument(
        "--tuning",
        default="model",
        choices=["model", "measure"],
        help="Tessera kernels' schedules: the model's pick, or timed at start-up (kept on disk for restarts)",
    )
    p.add_argument("--max-batch-tokens", type=positive_int, default=16384, help="longest x batch size")
    p.add_argument("--max-batch-size", type=positive_int, default=32, help="inputs per batch")
    p.add_argument("--max-queue", type=positive_int, default=512, help="waiting inputs before 429")
    p.add_argument("--max-client-batch", type=positive_int, default=32, help="inputs per request")
    p.add_argument("--payload-limit", type=positive_int, default=2_000_000, help="request body bytes")
    p.add_argument("--overload-status", type=int, default=429, choices=[429, 503], help="full-queue status")
    p.add_argument(
        "--threads",
        type=positive_int,
        help="torch intra-op threads of each worker (default: torch's; --task generate: 1 per rank)",
    )
    p.add_argument(
        "--workers",
        type=_workers(positive_int),
        default="auto",
        help="engine workers, each with its own model copy, taking batches as they free up "
        "(with more than 1, --threads defaults to 1 per worker); default auto: one per core this "
        "process may use, divided by --threads",
    )
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
    p.add_argument("--replicas", type=positive_int, default=1, help="Ray Serve replicas (with --ray)")
    from tessera.serve.generate_commands import add_generate_flags

    add_generate_flags(p, positive_int)
    p.set_defaults(handler=cmd_serve, serve_parser=p)
