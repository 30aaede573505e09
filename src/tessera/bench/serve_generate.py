"""`tessera bench serve-generate`: the generation server under an open-loop load of mixed
requests, on the digits DiT (8x8, mixed step counts and image counts) and a small
PixArt-shaped pipeline (mixed sizes and step counts).

For each model the same arrivals (Poisson, one seed per repeat) are sent over HTTP to:
serial (one rank with every core's threads), each 2-rank layout (one thread per rank), each
with batching (requests of one size and step count share a batch) and without (one request
per batch). The best 2-rank layout is the one with the highest batched throughput. The rate
is set from the serial server's own capacity without batching (``LOAD`` times the requests
per second it serves with the whole mix waiting), so
every system is loaded to (or past) its capacity: the throughput is what it can serve, and
queueing shows in the latencies, as for real clients.

Reported per run: p50 and p99 request latency (sent to answered), throughput (images per
second over the run), mean images per batch; headline ratios are medians over the repeats
with their spread (min..max).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.bench.harness import BenchResult

LOAD = 2.0  # arrival rate / the serial server's capacity for the mix: past every system's capacity


@dataclass(frozen=True)
class Plan:
    requests: int  # per run
    repeats: int
    digits_steps: tuple[int, ...]
    pixart_steps: tuple[int, ...]
    pixart_latents: tuple[int, ...]  # latent sizes (square); pixels = latent x the VAE factor
    layouts: tuple[str, ...]  # 2-rank layouts tried


QUICK = Plan(requests=24, repeats=3, digits_steps=(4, 8), pixart_steps=(2, 4), pixart_latents=(16, 24),
             layouts=("cfg",))  # fmt: skip
FULL = Plan(requests=80, repeats=3, digits_steps=(8, 16, 32), pixart_steps=(6, 12), pixart_latents=(16, 32),
            layouts=("ulysses", "cfg", "pipefusion"))  # fmt: skip


def _layout(name: str):
    from tessera.diffusion.layout import ParallelConfig

    return {
        "serial": ParallelConfig(),
        "ulysses": ParallelConfig(ulysses=2),
        "cfg": ParallelConfig(cfg_parallel=True),
        "pipefusion": ParallelConfig(pipefusion=2, patches=2, warmup_steps=1),
    }[name]


# ---- models ----------------------------------------------------------------------------


def digits_model(folder: Path) -> Path:
    """The trained digits DiT if `tessera train --recipe digits-dit` wrote one, else the
    recipe's architecture with random weights (the speed depends on shapes only)."""
    trained = Path("runs/digits-dit")
    if (trained / "model.safetensors").is_file():
        return trained
    from tessera.models.dit import DiT
    from tessera.train.checkpoint import save_checkpoint
    from tessera.train.digits_dit import DigitsDiTRecipe

    torch.manual_seed(0)
    model = DiT(DigitsDiTRecipe().model)
    return save_checkpoint(folder / "digits-dit", config={"model": model.config.to_dict()},
                           weights=model.state_dict())  # fmt: skip


def pixart_model(folder: Path) -> Path:
    """A PixArt-alpha pipeline of small parts (random weights, a word-level tokenizer made
    in code), saved as a download would be: 4 blocks, 4 heads of 16, a 2x VAE."""
    from diffusers import (
        AutoencoderKL,
        DPMSolverMultistepScheduler,
        PixArtAlphaPipeline,
        PixArtTransformer2DModel,
    )
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    torch.manual_seed(0)
    words = "a an the photo of cat dog red blue green small large painting sky sea tree house".split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                           d_kv=16)).eval()  # fmt: skip
    transformer = PixArtTransformer2DModel(
        sample_size=16, num_layers=4, attention_head_dim=16, num_attention_heads=4, in_channels=4,
        out_channels=8, cross_attention_dim=64, caption_channels=32, patch_size=2, norm_type="ada_norm_single",
        num_embeds_ada_norm=1000,
    )  # fmt: skip
    with torch.no_grad():  # off adaLN-zero's start, where every block is the identity
        for p in transformer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=32)  # fmt: skip
    pipe = PixArtAlphaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                               transformer=transformer.eval(), scheduler=DPMSolverMultistepScheduler())  # fmt: skip
    pipe.save_pretrained(folder / "pixart")
    return folder / "pixart"


# ---- load ------------------------------------------------------------------------------


def requests_for(model: str, plan: Plan, seed: int, sizes: list[str]) -> list[dict]:
    rng = random.Random(seed)
    bodies = []
    for i in range(plan.requests):
        if model == "digits":
            body = {"labels": [rng.randrange(10) for _ in range(rng.choice((1, 2)))],
                    "steps": rng.choice(plan.digits_steps)}  # fmt: skip
        else:
            w, h = (int(x) for x in rng.choice(sizes).split("x"))
            body = {"prompt": rng.choice(("a red cat", "a blue house by the sea", "a small green tree")),
                    "height": h, "width": w, "steps": rng.choice(plan.pixart_steps)}  # fmt: skip
        bodies.append(body | {"seed": i, "guidance": 2.0})
    return bodies


async def _open_loop(url: str, bodies: list[dict], rate: float, seed: int) -> list[dict]:
    import httpx

    rng, records = random.Random(seed), []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        began = time.perf_counter()

        async def send(body: dict) -> None:
            sent = time.perf_counter() - began
            r = await client.post("/generate", json=body)
            done = time.perf_counter() - began
            answer = r.json() if r.status_code == 200 else {}
            records.append({"sent": sent, "done": done, "status": r.status_code,
                            "images": len(answer.get("images", [])), "batch": answer.get("batch_images", 0)})  # fmt: skip

        tasks, at = [], 0.0
        for body in bodies:
            at += rng.expovariate(rate)
            delay = at - (time.perf_counter() - began)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(body)))
        await asyncio.gather(*tasks)
    return records


def summarize(records: list[dict]) -> dict:
    ok = [r for r in records if r["status"] == 200]
    latencies = sorted(r["done"] - r["sent"] for r in ok)
    span = max(r["done"] for r in ok) - min(r["sent"] for r in records)
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return {
        "p50_s": round(q[49], 4),
        "p99_s": round(q[98], 4),
        "images_per_s": round(sum(r["images"] for r in ok) / span, 3),
        "mean_batch_images": round(statistics.mean(r["batch"] for r in ok), 2),
        "errors": len(records) - len(ok),
    }


# ---- runs ------------------------------------------------------------------------------


def _service(model_dir: Path, layout: str, sizes, threads: int, max_batch_images: int):
    from tessera.serve.generate_server import GenerateServeConfig, build_generate_service, generate_app
    from tessera.serve.generate_spec import Limits

    config = _layout(layout)
    serve = GenerateServeConfig(model=str(model_dir), layout=config, nproc=config.world_size, port=0,
                                sizes=tuple(sizes), threads=threads, max_queue=1024,
                                limits=Limits(max_batch_images=max_batch_images))  # fmt: skip
    service, metrics = build_generate_service(serve)
    return service, generate_app(serve, service, metrics)


def _measure(url, service, bodies, rate, seed, batching: bool, max_batch_images: int) -> dict:
    # the scheduler reads its limit per batch; the app's validation keeps the server's own
    service.limits = dataclasses.replace(service.limits, max_batch_images=max_batch_images, batching=batching)
    return summarize(asyncio.run(_open_loop(url, bodies, rate, seed)))


def _calibrate(url: str, bodies: list[dict]) -> float:
    """Seconds per request the server takes when every request of the mix is waiting at once
    (its capacity: queueing overlaps the HTTP and hand-over costs of one request with the
    compute of another, as under load)."""
    import httpx

    async def burst() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            (await client.post("/generate", json=bodies[0])).raise_for_status()  # warm-up
            began = time.perf_counter()
            answers = await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
            for a in answers:
                a.raise_for_status()
            return (time.perf_counter() - began) / len(bodies)

    return asyncio.run(burst())


def _serial_threads(model_dir: Path, parsed, cores: int, mix: list[dict], say) -> tuple[int, float]:
    """The serial server at its strongest: the thread count (1 or every core) that serves the
    mix faster here (on a shared machine, intra-op threads can lose to one), and its seconds
    per request."""
    from tessera.serve.generate_server import serve_in_thread

    best = None
    for threads in sorted({1, cores}):
        service, app = _service(model_dir, "serial", parsed, threads, 8)
        service.limits = dataclasses.replace(service.limits, batching=False)  # the baseline's own capacity
        try:
            with serve_in_thread(app) as url:
                seconds = _calibrate(url, mix)
        finally:
            service.stop()
        say(f"  serial, {threads} thread(s): {seconds:.3f} s a request")
        if best is None or seconds < best[1]:
            best = (threads, seconds)
    return best


def run_model(name: str, model_dir: Path, sizes: list[str], plan: Plan, cores: int, say) -> tuple[list, dict]:
    from tessera.serve.generate_server import serve_in_thread
    from tessera.serve.generate_spec import parse_sizes

    parsed = parse_sizes(",".join(sizes)) if sizes else []
    mix = [requests_for(name, plan, seed, sizes) for seed in range(plan.repeats)]
    serial_threads, seconds = _serial_threads(model_dir, parsed, cores, mix[0], say)
    rate = LOAD / seconds
    say(f"{name}: serial serves {1 / seconds:.2f} requests/s; open-loop load {rate:.2f}/s")
    rows = []
    for layout in ("serial", *plan.layouts):
        threads = serial_threads if layout == "serial" else max(1, cores // 2)  # a core per rank
        service, app = _service(model_dir, layout, parsed, threads, 8)
        try:
            with serve_in_thread(app) as url:
                _calibrate(url, mix[0][:2])  # warm-up
                for batching in (False, True):
                    for repeat in range(plan.repeats):
                        stats = _measure(url, service, mix[repeat], rate, 100 + repeat, batching, 8)
                        row = {"model": name, "layout": service.group.config.describe(), "system": layout,
                               "ranks": service.group.world_size, "threads_per_rank": threads,
                               "batching": batching, "repeat": repeat, "rate_per_s": round(rate, 3), **stats}  # fmt: skip
                        rows.append(row)
                        say(f"  {layout} batching={batching} #{repeat}: {stats}")
        finally:
            service.stop()
    return rows, {"rate_per_s": rate, "serial_threads": serial_threads}


def _median(rows, key, **where) -> float:
    return statistics.median(r[key] for r in rows if all(r[k] == v for k, v in where.items()))


def _spread(rows, key, **where) -> list[float]:
    values = [r[key] for r in rows if all(r[k] == v for k, v in where.items())]
    return [min(values), max(values)]


def _headline(rows: list[dict], plan: Plan) -> dict:
    out: dict = {}
    for model in ("digits", "pixart"):
        mine = [r for r in rows if r["model"] == model]
        best = max(plan.layouts, key=lambda lay: _median(mine, "images_per_s", system=lay, batching=True))
        serial = _median(mine, "images_per_s", system="serial", batching=False)
        ratios = [b["images_per_s"] / s["images_per_s"] for b, s in zip(
            [r for r in mine if r["system"] == best and r["batching"]],
            [r for r in mine if r["system"] == "serial" and not r["batching"]], strict=True)]  # fmt: skip
        batch_gain = [b["images_per_s"] / u["images_per_s"] for b, u in zip(
            [r for r in mine if r["system"] == best and r["batching"]],
            [r for r in mine if r["system"] == best and not r["batching"]], strict=True)]  # fmt: skip
        out[model] = {
            "best_2rank_layout": best,
            "serial_images_per_s": serial,
            "serial_batched_images_per_s": _median(mine, "images_per_s", system="serial", batching=True),
            "best_batched_images_per_s": _median(mine, "images_per_s", system=best, batching=True),
            "throughput_vs_serial": round(statistics.median(ratios), 2),
            "throughput_vs_serial_spread": [round(min(ratios), 2), round(max(ratios), 2)],
            "batching_gain": round(statistics.median(batch_gain), 2),
            "batching_gain_spread": [round(min(batch_gain), 2), round(max(batch_gain), 2)],
            "p50_s_serial": _median(mine, "p50_s", system="serial", batching=False),
            "p99_s_serial": _median(mine, "p99_s", system="serial", batching=False),
            "p50_s_best_batched": _median(mine, "p50_s", system=best, batching=True),
            "p99_s_best_batched": _median(mine, "p99_s", system=best, batching=True),
        }
    return out


def run_serve_generate_bench(quick: bool = False, progress: bool = True) -> BenchResult:
    import os

    plan = QUICK if quick else FULL
    cores = min(os.cpu_count() or 1, 2) if quick else os.cpu_count() or 1

    def say(message: str) -> None:
        if progress:
            print(message, flush=True)

    rows, rates, load = [], {}, os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
        folder = Path(tmp)
        digits = digits_model(folder)
        pixart = pixart_model(folder)
        latents = [f"{2 * s}x{2 * s}" for s in plan.pixart_latents]  # the VAE's factor is 2
        for name, model_dir, sizes in (("digits", digits, []), ("pixart", pixart, latents)):
            model_rows, extra = run_model(name, model_dir, sizes, plan, cores, say)
            rows += model_rows
            rates[name] = extra
    columns = ["model", "system", "layout", "ranks", "threads_per_rank", "batching", "repeat", "rate_per_s", "p50_s", "p99_s",
               "images_per_s", "mean_batch_images", "errors"]  # fmt: skip
    notes = [
        f"Open-loop Poisson arrivals at {LOAD}x the serial server's measured capacity for the mix (no batching) "
        f"({plan.requests} requests a run, {plan.repeats} repeats with different arrivals and mixes).",
        "digits: the digits DiT (8x8; trained weights if runs/digits-dit exists, else random), "
        f"steps {plan.digits_steps}, 1-2 images a request; pixart: a small PixArt-alpha pipeline, sizes "
        f"{', '.join(latents)} px, steps {plan.pixart_steps}; guidance 2 everywhere.",
        f"serial = 1 rank with 1 or {cores} threads, whichever served the mix faster in this run "
        f"(threads_per_rank); 2-rank layouts = {max(1, cores // 2)} thread(s) per rank; "
        "batching = up to 8 images of one size and step count per batch.",
        f"Load average when the run began: {load[0]:.1f} (1 min) on {os.cpu_count()} cores: other work shared "
        "the machine, so ratios are indicative only.",
    ]
    return BenchResult(name="serve-generate", headline=_headline(rows, plan), rows=rows, columns=columns,
                       notes=notes, extra={"load": rates, "plan": dataclasses.asdict(plan)})  # fmt: skip


def plot_serve_generate(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, model in zip(axes, ("digits", "pixart"), strict=True):
        mine = [r for r in result.rows if r["model"] == model]
        systems = list(dict.fromkeys(r["system"] for r in mine))
        for batching, marker in ((False, "o"), (True, "s")):
            xs = [_median(mine, "images_per_s", system=s, batching=batching) for s in systems]
            ys = [_median(mine, "p99_s", system=s, batching=batching) for s in systems]
            ax.scatter(xs, ys, marker=marker, label=f"batching {'on' if batching else 'off'}")
            for x, y, s in zip(xs, ys, systems, strict=True):
                ax.annotate(s, (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"{model}: throughput vs p99 latency (medians)")
        ax.set_xlabel("images / s")
        ax.set_ylabel("p99 latency (s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
