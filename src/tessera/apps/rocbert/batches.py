"""Tensor batches for ROCBERT's two stages, built the same on every rank from the step
number (``boost`` hands each data-parallel rank its share of the rows).

Pretraining follows ``RoCBertForPreTraining.forward``: ``input_*`` is the masked clean text,
``labels_input_*`` the clean text itself (the MLM loss runs over every non-pad position and
the clean copy is the contrastive term's second anchor, as transformers' own example does),
``attack_*`` the synthesiser's copy. The contrastive term takes the other rows of a micro-batch
as negatives, so it is computed per rank and micro-batch (as the paper's per-device batch).
Fine-tuning interleaves each review with its attacked copy, both carrying the review's label.
"""

from __future__ import annotations

import torch

from tessera.apps.rocbert.attacks import Synthesizer
from tessera.apps.rocbert.features import is_hanzi

KEYS = ("input_ids", "input_shape_ids", "input_pronunciation_ids", "attention_mask")
MASK_PROB = 0.15  # BERT's share of masked positions; of them 80% [MASK], 10% random, 10% kept


class Encoder:
    """Texts -> padded RoCBert id tensors through transformers' RoCBertTokenizer."""

    def __init__(self, tokenizer, max_len: int):
        self.tokenizer, self.max_len = tokenizer, max_len

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(
            texts, padding="max_length", truncation=True, max_length=self.max_len, return_tensors="pt"
        )
        return {k: enc[k] for k in KEYS}

    def clip(self, text: str) -> str:
        return text[: self.max_len - 2]  # attack what the window holds, not what truncation drops


def mask_tokens(enc: dict[str, torch.Tensor], tokenizer, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A masked copy of ``enc``: the three id views of a masked position change together."""
    ids = enc["input_ids"]
    special = torch.tensor([[t in tokenizer.all_special_ids for t in row] for row in ids.tolist()])
    chosen = (torch.rand(ids.shape, generator=g) < MASK_PROB) & ~special
    roll = torch.rand(ids.shape, generator=g)
    to_mask, to_random = chosen & (roll < 0.8), chosen & (roll >= 0.8) & (roll < 0.9)
    random_ids = torch.randint(len(tokenizer.all_special_ids), tokenizer.vocab_size, ids.shape, generator=g)
    out = {k: v.clone() for k, v in enc.items()}
    mask_id = tokenizer.mask_token_id
    views = {
        "input_ids": (mask_id, random_ids),
        "input_shape_ids": (tokenizer.word_shape["[MASK]"], random_ids),  # shape id = vocab id
        "input_pronunciation_ids": (
            tokenizer.word_pronunciation["[MASK]"],
            torch.tensor(
                [
                    [tokenizer.word_pronunciation[tokenizer.ids_to_tokens[i]] for i in row]
                    for row in random_ids.tolist()
                ]
            ),
        ),
    }
    for key, (masked, rnd) in views.items():
        out[key][to_mask] = masked
        out[key][to_random] = rnd[to_random]
    return out


def step_generator(seed: int, step: int, stage: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4 + stage)


def pretrain_batch(
    texts, encoder: Encoder, syn: Synthesizer, g: torch.Generator, attack_seed: int, contrastive: bool
):
    clean_texts = [encoder.clip(t) for t in texts]
    clean = encoder(clean_texts)
    batch = mask_tokens(clean, encoder.tokenizer, g)
    labels = {f"labels_{k}": v for k, v in clean.items()}
    labels["labels_input_ids"] = clean["input_ids"].masked_fill(clean["attention_mask"] == 0, -100)
    batch.update(labels)
    if contrastive:
        attacked = encoder([syn.attack(t, seed=attack_seed)[0] for t in clean_texts])
        batch.update({f"attack_{k}": v for k, v in attacked.items()})
    return batch


def finetune_batch(
    rows, encoder: Encoder, syn: Synthesizer, attack_seed: int, attacked_copies: bool, prefer=None
):
    """``rows`` of (review, label); with ``attacked_copies`` each is followed by its attacked copy.
    ``prefer``: per row, the positions its copy attacks first (``salient_positions``)."""
    texts, labels = [], []
    for k, (text, label) in enumerate(rows):
        clip = encoder.clip(text)
        texts.append(clip)
        labels.append(label)
        if attacked_copies:
            texts.append(syn.attack(clip, seed=attack_seed, prefer=prefer[k] if prefer else None)[0])
            labels.append(label)
    batch = encoder(texts)
    batch["labels"] = torch.tensor(labels)
    return batch


def salient_positions(model, encoder: Encoder, texts: list[str], labels: list[int]) -> list[list[int]]:
    """Per text, its Chinese characters' positions, most salient first: the norm of the
    classification loss's gradient at each character's word embedding, in eval mode (no
    dropout, so every rank gets the same order). The defender may read its own gradients; the
    attack the model meets later stays black-box. Parameter gradients are not touched."""
    device = next(model.parameters()).device
    enc = {k: v.to(device) for k, v in encoder(texts).items()}
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            words = model.roc_bert.embeddings.word_embeddings(enc["input_ids"]).detach().requires_grad_()
            loss = model(
                inputs_embeds=words,
                input_shape_ids=enc["input_shape_ids"],
                input_pronunciation_ids=enc["input_pronunciation_ids"],
                attention_mask=enc["attention_mask"],
                labels=torch.tensor(labels, device=device),
            ).loss
            (grad,) = torch.autograd.grad(loss, words)
    finally:
        model.train(was_training)
    scores = grad.norm(dim=-1).tolist()
    rows = zip(texts, enc["input_ids"].tolist(), scores, strict=True)
    return [_by_score(encoder.tokenizer, text, ids, s) for text, ids, s in rows]


def _by_score(tokenizer, text: str, ids: list[int], scores: list[float]) -> list[int]:
    """Match each Chinese character of ``text`` to its token (one token per character, or
    [UNK] for one outside the vocabulary, in order) and sort the positions by the token's score;
    characters the window cut off come last."""
    hanzi = [i for i, ch in enumerate(text) if is_hanzi(ch)]
    score, k = {}, 0
    for token, s in zip(tokenizer.convert_ids_to_tokens(ids), scores, strict=True):
        if k == len(hanzi):
            break
        ch = text[hanzi[k]]
        if token == ch or (token == tokenizer.unk_token and ch not in tokenizer.vocab):
            score[hanzi[k]], k = s, k + 1
    return sorted(hanzi, key=lambda i: -score.get(i, float("-inf")))
