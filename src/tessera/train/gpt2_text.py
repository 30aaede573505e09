"""Recipe ``gpt2-text``: a small byte-level GPT-2 (HuggingFace ``GPT2LMHeadModel``) trained
under any ``Plan`` on text that ships with Python itself — the sources of a fixed list of
standard-library modules — so it runs offline anywhere.

Every rank builds the same global batches from the step number (windows at positions drawn
from a seeded generator); ``boost`` hands each data-parallel rank its share. Metrics per
logged step: loss, tokens/s, achieved FLOP/s and an MFU estimate, peak resident memory of
the rank, the bytes each mesh axis moved, and (fp16) the loss scale and skipped steps. The
learning rate warms up linearly over ``warmup_steps`` (an LR scheduler on the optimizer);
``--resume`` restores it with the weights, optimizer state and RNG states.
"""

from __future__ import annotations

import json
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from tessera.memory.track import status_kib
from tessera.train.losses import causal_lm_loss

RECIPE_NAME = "gpt2-text"
SOURCES = ("textwrap.py", "string.py", "fractions.py", "heapq.py", "bisect.py", "difflib.py", "shlex.py")


@dataclass(frozen=True, kw_only=True)
class GPT2TextRecipe:
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    seq: int = 128
    batch_size: int = 16
    steps: int = 200
    lr: float = 3e-3
    warmup_steps: int = 20
    seed: int = 0
    log_every: int = 20

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "lr" and (not isinstance(value, int) or value < (0 if name == "seed" else 1)):
                raise ValueError(f"GPT2TextRecipe.{name} must be a positive integer, got {value!r}")


def corpus() -> torch.Tensor:
    """The bytes of the standard-library sources in SOURCES, as a 1-D uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = b"\n".join((root / name).read_bytes() for name in SOURCES)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def global_batch(recipe: GPT2TextRecipe, step: int, text: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(recipe.seed * 1_000_003 + step)
    starts = torch.randint(0, len(text) - recipe.seq, (recipe.batch_size,), generator=g)
    return torch.stack([text[s : s + recipe.seq] for s in starts.tolist()]).long()


def gpt2_lm(*, vocab: int, n_embd: int, n_layer: int, n_head: int, seq: int, seed: int = 0) -> nn.Module:
    """A HuggingFace GPT2LMHeadModel from sizes, dropout off, seeded (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_positions=seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-character table (Radford et al. 2019, ``bytes_to_unicode``): printable
    bytes stand for themselves, the others for characters from U+0100 on, so that a byte-level
    BPE vocabulary is text."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def byte_tokenizer(max_length: int):
    """The recipe's tokenizer as a transformers one: token id = UTF-8 byte (a byte-level BPE
    with the 256 bytes and no merges, no special tokens), so decode(encode(text)) == text for
    any text and the ids are exactly what the recipe trains on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, model_max_length=max_length, clean_up_tokenization_spaces=False
    )


def flops_per_token(params: int, n_layer: int, n_embd: int, seq: int) -> float:
    """Training FLOPs per token: 6 per parameter, plus attention scores and values."""
    return 6 * params + 12 * n_layer * n_embd * seq


def warmup(steps: int):
    """The LR factor of a linear warm-up over ``steps`` optimizer steps, then constant."""
    return lambda step: min(1.0, (step + 1) / steps)


def build_model(recipe: GPT2TextRecipe) -> nn.Module:
    return gpt2_lm(
        vocab=256,
        n_embd=recipe.n_embd,
        n_layer=recipe.n_layer,
        n_head=recipe.n_head,
        seq=recipe.seq,
        seed=recipe.seed,
    )


def write_log(path: Path, plan, log: list[dict], *, resumed_from: int | None) -> None:
    """``train_log.json``: ``plan`` (the first run's), ``log`` (every logged step of every
    run, in order) and ``resumes`` (each resume: the step it continued from and its plan).
    A resume appends to the log its checkpoint's run wrote."""
    record: dict = {"plan": plan.to_dict(), "log": [], "resumes": []}
    if resumed_from is not None:
        resume = {"resumed_from": resumed_from, "plan": plan.to_dict()}
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):  # no earlier log to keep: say so where it would be
            resume["earlier_log"] = "missing"
        record.setdefault("resumes", []).append(resume)
    record["log"] += log
    path.write_text(json.dumps(record, indent=2))


def train_rank(
    recipe: GPT2TextRecipe,
    plan,
    out: str | None,
    resume: bool,
    matmul_peak: float,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
) -> dict:
    """One rank of a run (called under spawn or torchrun's agent). With ``checkpoint_dir`` it
    resumes from the newest checkpoint there by itself (``tessera.train.resume_or_start``: a
    restarted rank goes on from there; batch i is a function of i, so no sample is seen twice)
    and saves every ``checkpoint_every`` steps in the background."""
    from tqdm.auto import tqdm

    from tessera.train.boost import boost, plan_mesh
    from tessera.train.export import save_hf
    from tessera.train.sharded_checkpoint import load_sharded, save_sharded

    mesh = plan_mesh(plan)
    text = corpus()
    model = build_model(recipe)
    params = sum(p.numel() for p in model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, warmup(recipe.warmup_steps))
    model, opt = boost(model, inner, plan, mesh)
    first, ckpt = 0, None
    rank0 = torch.distributed.get_rank() == 0 if torch.distributed.is_initialized() else True
    if resume:
        first = load_sharded(model, opt, Path(out) / "checkpoint", scheduler=scheduler)["extra"]["step"]
    elif checkpoint_dir is not None:
        from tessera.train.resume import describe, resume_or_start

        ckpt = resume_or_start(model, opt, checkpoint_dir, scheduler=scheduler, every=checkpoint_every)
        first = ckpt.step
        if rank0 and ckpt.resumed_from is not None:
            print(describe(ckpt), flush=True)
    per_token = flops_per_token(params, recipe.n_layer, recipe.n_embd, recipe.seq)
    log = []
    began = time.perf_counter()
    window_start, window_tokens = began, 0
    bar = tqdm(range(first, recipe.steps), desc="train", disable=not rank0)
    for step in bar:
        stats = opt.train_step(global_batch(recipe, step, text), causal_lm_loss)
        scheduler.step()
        if ckpt is not None:
            ckpt.maybe_save(step + 1)
        window_tokens += recipe.batch_size * recipe.seq
        if (step + 1) % recipe.log_every == 0 or step + 1 == recipe.steps:
            now = time.perf_counter()
            tokens_per_s = window_tokens / (now - window_start)
            entry = {
                "step": step + 1,
                "loss": stats["loss"],
                "tokens_per_s": tokens_per_s,
                "achieved_gflops": tokens_per_s * per_token / 1e9,
                "mfu": tokens_per_s * per_token / (matmul_peak * plan.world_size),
                "peak_rss_mib": status_kib("VmHWM") / 1024,
                "comm_bytes": {k: v["bytes"] for k, v in mesh.comm.ledger.snapshot().items()},
                "lr": opt.param_groups[0]["lr"],
            }
            if "loss_scale" in stats:
                entry.update(loss_scale=stats["loss_scale"], skipped_steps=stats["skipped_steps"])
            log.append(entry)
            bar.set_postfix(
                loss=f"{entry['loss']:.3f}", tok_s=f"{tokens_per_s:.0f}", mfu=f"{entry['mfu']:.1%}"
            )
            window_start, window_tokens = now, 0
    if ckpt is not None:
        ckpt.wait()
    seconds = time.perf_counter() - began
    if out is not None:
        save_sharded(
            model,
            opt,
            Path(out) / "checkpoint",
            scheduler=scheduler,
            extra={"step": recipe.steps, "recipe": asdict(recipe)},
        )
        save_hf(model, opt, Path(out) / "hf", is_writer=rank0, tokenizer=byte_tokenizer(recipe.seq))
        if rank0:
            resumed = resume or (ckpt is not None and ckpt.resumed_from is not None)
            write_log(Path(out) / "train_log.json", plan, log, resumed_from=first if resumed else None)
    return {
        "seconds": seconds,
        "steps_run": recipe.steps - first,
        "final_loss": log[-1]["loss"] if log else None,
        "log": log,
    }
