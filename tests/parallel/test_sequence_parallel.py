"""Sequence-parallel attention for training (tessera.parallel.sequence): outputs and the
gradients of q, k and v equal one process's attention over the whole sequence, causal and
not, Ulysses and Ring (zig-zag for causal), on 2 and 4 ranks.

Tolerance 1e-5 relative: float32 attention computed blockwise and merged by log-sum-exp
reorders the sums of softmax-weighted values (measured ~1e-7 here); an error in which block
a gradient lands on, or a missed mask, is of order 1."""

import torch
import torch.nn.functional as F

from tessera.runtime import Mesh, spawn

B, H, T, D = 2, 4, 16, 8
TOL = 1e-5


def _full(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    return q, k, v, w


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _rank_run() -> dict:
    from tessera.parallel.sequence import ring_attention, ulysses_attention, zigzag_merge, zigzag_split

    mesh = Mesh(sp=torch.distributed.get_world_size())
    n, me = mesh.size("sp"), mesh.rank("sp")
    errors = {}
    for method in ("ulysses", "ring"):
        for causal in (False, True):
            q, k, v, w = _full()
            if method == "ring" and causal:
                share = lambda t: zigzag_split(t, n, me)  # noqa: E731
            else:
                share = lambda t: t.chunk(n, dim=2)[me]  # noqa: E731
            ql, kl, vl = (share(t).clone().requires_grad_() for t in (q, k, v))
            fn = ulysses_attention if method == "ulysses" else ring_attention
            out = fn(ql, kl, vl, mesh.comm, "sp", causal=causal)
            (out * share(w)).sum().backward()
            gathered = [
                mesh.comm.all_gather(t.detach().contiguous(), "sp", dim=0)
                for t in (out, ql.grad, kl.grad, vl.grad)
            ]
            if method == "ring" and causal:
                full = [zigzag_merge(list(t.chunk(n, dim=0))) for t in gathered]
            else:
                full = [torch.cat(t.chunk(n, dim=0), dim=2) for t in gathered]
            rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(rq, rk, rv, is_causal=causal)
            (ref * w).sum().backward()
            errors[f"{method}-{'causal' if causal else 'full'}"] = [
                _rel(a, b) for a, b in zip(full, (ref.detach(), rq.grad, rk.grad, rv.grad), strict=True)
            ]
    return errors


def test_sequence_parallel_attention_equals_one_process_on_2_and_4_ranks():
    for world in (2, 4):
        errors = spawn(_rank_run, world)[0]
        assert len(errors) == 4
        for name, errs in errors.items():
            assert max(errs) < TOL, (world, name, errs)


def test_zigzag_layout_round_trips_and_rejects_odd_lengths():
    import pytest

    from tessera.parallel.sequence import zigzag_merge, zigzag_split

    x = torch.arange(16.0).view(1, 1, 16, 1)
    parts = [zigzag_split(x, 4, r) for r in range(4)]
    assert parts[0].flatten().tolist() == [0, 1, 14, 15]
    assert torch.equal(zigzag_merge(parts), x)
    with pytest.raises(ValueError, match="does not split into 2 x 3"):
        zigzag_split(x, 3, 0)


def _lm(family: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
        )
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=16, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _ids():
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))


def _lm_rank_run() -> list:
    from tessera.parallel.sequence import SequenceParallel

    mesh = Mesh(sp=torch.distributed.get_world_size())
    out = []
    for family in ("gpt2", "llama"):
        for method in ("ring", "ulysses"):
            model = _lm(family)
            sp = SequenceParallel(model, mesh.comm, "sp", method)
            loss = sp.loss(_ids())
            loss.backward()
            sp.reduce_gradients()
            out.append(
                (family, method, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
            )
    return out


def test_transformers_lm_trains_sequence_parallel_like_one_process():
    """GPT-2 (learned positions) and Llama (rotary, grouped-query attention), causal, Ring
    (zig-zag) and Ulysses on 2 ranks: the loss and every gradient equal one process's
    (same tolerance and reason as above)."""
    results = spawn(_lm_rank_run, 2)
    for i, (family, method, loss, grads) in enumerate(results[0]):
        model = _lm(family)
        ids = _ids()
        logits = model(ids).logits
        ref = F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
        ref.backward()
        assert abs(loss - ref.item()) < TOL * ref.item() and results[1][i][2] == loss, (family, method)
        for name, p in model.named_parameters():
            assert _rel(grads[name], p.grad) < TOL, (family, method, name)


def test_a_sequence_parallel_model_still_runs_whole_sequences():
    """SequenceParallel sets the model's attention for good (activation checkpointing
    recomputes layers after the forward returned); called without its keyword, e.g. for
    evaluation on one process, the model is the plain causal model (same logits; 1e-6: the
    same sdpa call through another entry point)."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "train"))
    from tiny_lm import VOCAB, tiny_llama

    from tessera.parallel.sequence import IMPLEMENTATION, SequenceParallel

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = tiny_llama()
    expected = plain(input_ids=ids).logits
    model = tiny_llama()
    SequenceParallel(model, Mesh(sp=1).comm, "sp", "ring")
    assert model.config._attn_implementation == IMPLEMENTATION
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-6, atol=1e-6)


def test_a_sequence_parallel_model_run_whole_keeps_every_feature():
    """Run whole after SequenceParallel switched its attention (no SP keyword): padding,
    windows, soft-caps and sinks as the model's own attention has them (the battery's
    families on its padded batch; 1e-5: eager attention against sdpa masks or the same eager
    formula, fp32)."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "train"))
    from attention_families import padded_batches, tiny_family

    from tessera.parallel.sequence import SequenceParallel
    from tessera.train.losses import causal_lm_loss

    batch = padded_batches(1)[0]
    real = batch["attention_mask"].bool()
    for family in ("mistral", "gemma2", "gpt_oss"):
        expected = tiny_family(family)(**batch).logits
        model = tiny_family(family)
        SequenceParallel(model, Mesh(sp=1).comm, "sp", "ulysses")
        got = model(**batch).logits
        torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5, msg=family)
        assert torch.isfinite(causal_lm_loss(model, batch))


def test_attention_arguments_the_kernel_does_not_implement_are_refused():
    import pytest

    from tessera.parallel.sequence import _hf_attention, check_sequence_parallel

    model = _lm("llama")
    layer = model.model.layers[0].self_attn
    q = k = v = torch.zeros(1, 4, 4, 8)
    with pytest.raises(ValueError, match="passes output_attentions=True to its attention function"):
        _hf_attention(layer, q, k, v, None, output_attentions=True)
    layer.train()
    with pytest.raises(ValueError, match="applies attention dropout 0.1 in training"):
        _hf_attention(layer, q, k, v, None, dropout=0.1)
    model.config.attention_chunk_size = 8
    with pytest.raises(ValueError, match=r"config.attention_chunk_size=8 \(chunked local attention\)"):
        check_sequence_parallel(model)
    model.config.attention_chunk_size = None
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"layer types \['linear_attention'\]"):
        check_sequence_parallel(model)
