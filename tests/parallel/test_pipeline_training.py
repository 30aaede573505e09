"""Pipeline-parallel training (tessera.parallel.pipeline on torch.distributed.pipelining):
the loss and every parameter's gradient equal one process's on the whole batch, for GPT-2
(head tied to the embedding across the first and last stage) and Llama, GPipe / 1F1B on 2
and 4 ranks, interleaved 1F1B with 2 virtual stages per rank on 2 and 4 ranks, and a layer
count the stages do not divide.

Tolerance 1e-5 relative: the micro-batches' gradients are averaged in another order than
the full batch's (float32; measured ~1e-7); a missed tied gradient or a wrong stage
boundary is of order 1."""

import pytest
import torch
import torch.nn.functional as F

from tessera.runtime import Mesh, spawn

VOCAB, SEQ, BATCH, TOL = 64, 8, 4, 1e-5


def lm_loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _model(family: str, layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = GPT2Config(
            n_layer=layers,
            n_embd=32,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=SEQ,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, ids.clone()


def _reference(family: str, layers: int) -> tuple[float, dict]:
    model = _model(family, layers)
    ids, labels = _batch()
    loss = lm_loss(model(ids).logits, labels)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank_run(cases, dp: int = 1) -> list:
    from tessera.parallel.pipeline import PipelineTrainer

    mesh = Mesh(dp=dp, pp=torch.distributed.get_world_size() // dp)
    out = []
    for family, layers, schedule, virtual in cases:
        model = _model(family, layers)
        names = {id(p): n for n, p in model.named_parameters()}
        # torch's 1F1B needs at least as many micro-batches as stages
        trainer = PipelineTrainer(
            model,
            mesh,
            lm_loss,
            microbatches=max(2, mesh.size("pp")),
            schedule=schedule,
            virtual_stages=virtual,
        )
        ids, labels = (t.chunk(dp)[mesh.rank("dp")] for t in _batch())  # this replica's share
        loss = trainer.step(ids, labels)
        if loss is not None and dp > 1:  # the mean over replicas is the full batch's loss
            mesh.comm.all_reduce(loss, "dp", op="avg")
        grads = {names[id(p)]: p.grad.clone() for p in trainer.parameters()}
        out.append((None if loss is None else loss.item(), grads))
    return out


CASES_2 = [
    ("gpt2", 4, "gpipe", 1),
    ("gpt2", 3, "1f1b", 1),
    ("llama", 4, "1f1b", 1),
    ("gpt2", 4, "interleaved", 2),
]
CASES_4 = [("llama", 5, "1f1b", 1), ("gpt2", 4, "gpipe", 1), ("gpt2", 8, "interleaved", 2)]
CASES_DP = [("gpt2", 4, "1f1b", 1)]


@pytest.mark.parametrize(
    "world,cases,dp", [(2, CASES_2, 1), (4, CASES_4, 1), (4, CASES_DP, 2)], ids=["pp2", "pp4", "pp2xdp2"]
)
def test_pipeline_training_equals_one_process(world, cases, dp):
    ranks = spawn(_rank_run, world, cases, dp)
    for i, (family, layers, schedule, _) in enumerate(cases):
        ref_loss, ref_grads = _reference(family, layers)
        losses = [r[i][0] for r in ranks if r[i][0] is not None]
        assert losses and abs(losses[0] - ref_loss) < TOL * abs(ref_loss), (schedule, losses, ref_loss)
        seen = set()
        for r in ranks:
            for name, grad in r[i][1].items():
                ref = ref_grads[name]
                # TOL relative (the docstring), + 1e-12 of room for rounding where a gradient is 0
                assert (grad - ref).norm() <= TOL * ref.norm() + 1e-12, (family, schedule, name)
                seen.add(name)
        assert seen == set(ref_grads), (family, schedule, set(ref_grads) - seen)


def test_bad_pipeline_settings_are_refused():
    from tessera.parallel.pipeline import stage_bounds

    assert stage_bounds(5, 2) == [(0, 3), (3, 5)]
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        stage_bounds(3, 4)
    with pytest.raises(ValueError, match=r"counts \(1, 1\) must be 2 positive numbers summing to 3"):
        stage_bounds(3, 2, (1, 1))


def _dit():
    from tessera.models.dit import DiT, DiTConfig

    torch.manual_seed(0)
    model = DiT(
        DiTConfig(
            image_size=8, in_channels=4, patch_size=2, hidden_size=32, depth=5, num_heads=4, num_classes=10
        )
    )
    with torch.no_grad():  # off adaLN-zero's start, where every block is the identity
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _dit_batch():
    g = torch.Generator().manual_seed(2)
    x, target = torch.randn(4, 4, 8, 8, generator=g), torch.randn(4, 4, 8, 8, generator=g)
    return (x, torch.rand(4, generator=g), torch.randint(0, 10, (4,), generator=g)), target


def _dit_rank_run(schedule: str) -> tuple:
    from tessera.parallel.pipeline import PipelineTrainer

    mesh = Mesh(pp=2)
    model = _dit()
    names = {id(p): n for n, p in model.named_parameters()}
    trainer = PipelineTrainer(model, mesh, F.mse_loss, microbatches=2, schedule=schedule)
    del model  # the stage keeps only its own blocks
    inputs, target = _dit_batch()
    loss = trainer.step(inputs, target)
    held = sum(p.numel() for p in trainer.parameters())
    grads = {names[id(p)]: p.grad.clone() for p in trainer.parameters()}
    return None if loss is None else loss.item(), grads, held


def test_dit_pipeline_training_equals_one_process():
    """Tessera's DiT, 5 blocks over 2 stages, the conditioning carried between stages:
    loss and every gradient equal one process's; each rank holds only its stage."""
    ref_model = _dit()
    inputs, target = _dit_batch()
    ref = F.mse_loss(ref_model(*inputs), target)
    ref.backward()
    total = sum(p.numel() for p in ref_model.parameters())
    for schedule in ("gpipe", "1f1b"):
        ranks = spawn(_dit_rank_run, 2, schedule)
        assert abs(ranks[1][0] - ref.item()) < TOL * ref.item() and ranks[0][0] is None
        assert ranks[0][2] + ranks[1][2] == total and max(ranks[0][2], ranks[1][2]) < total
        for name, p in ref_model.named_parameters():
            grad = next(r[1][name] for r in ranks if name in r[1])
            # + 1e-8: the key biases' gradient is 0 in exact arithmetic (softmax ignores a
            # shift shared by a query's scores), so only rounding (~1e-10) is left there;
            # every other gradient here is above 1e-4
            assert (grad - p.grad).norm() <= TOL * p.grad.norm() + 1e-8, (schedule, name)
