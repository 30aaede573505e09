"""What ``tessera train --recipe rocbert-sentiment`` and ``tessera robust attack`` run (cli.py
only parses the flags and calls these)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

LABELS = ("negative", "positive")
# the contrastive term's temperature (0.01) makes early gradients large: clip at 1 unless told
CLIP = 1.0  # the recipe's default Plan.max_grad_norm (tessera.cli_train.RECIPES)


def train_command(args: argparse.Namespace, plan, out: Path) -> str:
    """--steps sets both stages' steps; the recipe's own defaults otherwise. ``plan``: the
    Plan from the flags this recipe takes (tessera.cli_train refuses the others)."""
    from tessera.apps.rocbert.recipe import RECIPE_NAME, RocbertRecipe, recipe_features, train_rank
    from tessera.runtime import spawn

    overrides = {"seed": args.seed, "batch_size": args.batch_size}
    if args.steps is not None:
        overrides.update(pretrain_steps=args.steps, finetune_steps=args.steps)
    recipe = RocbertRecipe(**{k: v for k, v in overrides.items() if v is not None})
    if recipe.batch_size % (plan.dp * plan.grad_accum):
        raise ValueError(
            f"batch size {recipe.batch_size} does not split into dp={plan.dp} x grad_accum={plan.grad_accum}"
        )
    if (out / "model").exists():
        raise ValueError(f"{out} already holds a trained model; choose another --out")
    began = time.perf_counter()
    features = recipe_features(out / "features")  # built once, before the ranks start
    call = (recipe, plan, str(out), str(features.root), True)
    summary = (
        train_rank(*call)
        if args.nproc == 1
        else spawn(train_rank, args.nproc, *call, timeout_s=args.timeout)[0]
    )
    return (
        f"trained {RECIPE_NAME} ({recipe.pretrain_steps} pretraining + {recipe.finetune_steps} fine-tuning steps, "
        f"dp={plan.dp}) in {time.perf_counter() - began:.1f}s; final losses {summary['pretrain_loss'][-1]:.3f} / "
        f"{summary['finetune_loss'][-1]:.3f}; {recipe.eval_split} accuracy clean {summary['clean_accuracy']:.1%}, "
        f"attacked {summary['attacked_accuracy']:.1%} (n={summary['eval_size']}); model: {out / 'model'}"
    )


def load_model(folder: str | Path):
    """(model, features, encoder) from a folder the recipe wrote (``--out`` or its ``model/``)."""
    from transformers import RoCBertForSequenceClassification

    from tessera.apps.rocbert.batches import Encoder
    from tessera.apps.rocbert.features import load_features

    root = Path(folder)
    root = root / "model" if (root / "model" / "config.json").exists() else root
    if not (root / "config.json").exists():
        raise ValueError(
            f"{folder} holds no trained rocbert model (config.json); train one with tessera train --recipe rocbert-sentiment"
        )
    model = RoCBertForSequenceClassification.from_pretrained(root).eval()
    features = load_features(root)
    return model, features, Encoder(features.tokenizer(), model.config.max_position_embeddings)


def proba_fn(model, encoder):
    import torch

    device = next(model.parameters()).device

    @torch.no_grad()
    def proba(texts: list[str]) -> torch.Tensor:
        chunks = (encoder(texts[i : i + 128]) for i in range(0, len(texts), 128))
        return torch.cat(
            [model(**{k: v.to(device) for k, v in enc.items()}).logits.softmax(-1).cpu() for enc in chunks]
        )

    return proba


def attack_command(args: argparse.Namespace) -> str:
    """Each --text: the model's prediction, --variants synthetic attacks with theirs, and the
    three greedy black-box attacks' results (with their query counts): over the training
    synthesiser's substitutes, then the independent homophone/look-alike and synonym tables."""
    from tessera.apps.rocbert.attacks import Synthesizer
    from tessera.apps.rocbert.greedy import char_attack, greedy_attack, word_attack
    from tessera.apps.rocbert.independent import IndependentTables

    model, features, encoder = load_model(args.model)
    syn, proba, tables = Synthesizer(features), proba_fn(model, encoder), IndependentTables()
    lines = []
    for text in args.text:
        p = proba([text])[0]
        label = int(p.argmax())
        lines.append(f"{text}\n  model: {LABELS[label]} ({float(p[label]):.2f})")
        for seed in range(args.variants):
            attacked, edits = syn.attack(text, seed=args.seed + seed)
            q = proba([attacked])[0]
            kinds = ",".join(e.transform for e in edits) or "none (text under 6 characters)"
            lines.append(f"  {attacked}  -> {LABELS[int(q.argmax())]} ({float(q.max()):.2f})  [{kinds}]")
        runs = (
            ("char attack", char_attack, tables),
            ("word attack", word_attack, tables),
            ("greedy (synthesiser's substitutes)", greedy_attack, syn),
        )
        for name, attack, source in runs:
            g = attack(proba, text, label, source, query_budget=args.query_budget, seed=args.seed)
            verdict = "flipped" if g.success else "held"
            lines.append(f"  {name} ({g.queries} queries, {len(g.edits)} edits): {g.text}  -> {verdict}")
    return "\n".join(lines)
