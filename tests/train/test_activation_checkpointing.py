"""Plan(activation_checkpointing=True): each transformer block's forward is recomputed in
backward (counted), fewer activations are kept for backward (measured), and the step is the
same as without it on one process, dropout included (torch.utils.checkpoint replays the
RNG). For a transformers model HF's own mechanism wraps its layers; for the DiT,
Tessera wraps each block. Multi-rank parity (ZeRO-2/3, block chunks) is in
test_boost_parity.py."""

import pytest
import torch
from tiny_lm import SEQ, VOCAB, tiny_gpt2
from torch import nn

import tessera
from tessera.models.dit import DiT, DiTConfig
from tessera.train.blocks import transformer_blocks
from tessera.train.losses import causal_lm_loss


def _gpt2():
    model = tiny_gpt2()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.1
    return model, model.transformer.h[0].attn, torch.randint(0, VOCAB, (4, SEQ)), causal_lm_loss


def _dit():
    torch.manual_seed(0)
    model = DiT(DiTConfig(image_size=8, patch_size=2, hidden_size=32, depth=2, num_heads=4))
    batch = (torch.randn(4, 1, 8, 8), torch.rand(4), torch.randint(0, 10, (4,)), torch.randn(4, 1, 8, 8))

    def loss_fn(m, b):
        return nn.functional.mse_loss(m(b[0], b[1], b[2]), b[3])

    return model, model.blocks[0].attn, batch, loss_fn


def _run(build, checkpointing):
    model, probe, batch, loss_fn = build()
    calls, saved = [0], [0]
    probe.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    model, opt = tessera.boost(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tessera.Plan(activation_checkpointing=checkpointing),
    )

    def counting_loss(m, b):
        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return loss_fn(m, b)

    torch.manual_seed(7)  # the dropout masks
    loss = opt.train_step(batch, counting_loss)["loss"]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads, calls[0], saved[0]


@pytest.mark.parametrize("build", [_gpt2, _dit], ids=["gpt2 (HF layers)", "dit (Tessera wrapper)"])
def test_recomputes_each_block_and_takes_the_same_step(build):
    loss, grads, calls, saved = _run(build, False)
    ck_loss, ck_grads, ck_calls, ck_saved = _run(build, True)
    # the block ran again in backward (up to its last saved activation: torch's checkpoint
    # stops early, so the probe is a module near the block's start)
    assert (calls, ck_calls) == (1, 2)
    assert ck_saved < saved / 2, (ck_saved, saved)  # blocks' activations were not kept
    assert ck_loss == loss and grads.keys() == ck_grads.keys()
    for name, g in grads.items():
        # equal but for the order in which a tied weight's two contributions (GPT-2's
        # embedding and lm_head) are summed once backward interleaves recomputation: fp32
        # rounding, ~1e-7 relative; where the two nearly cancel, ~1e-7 of the contributions'
        # size (gradients up to ~0.15 here): 1e-8 absolute (3.7e-9 seen on one machine)
        torch.testing.assert_close(ck_grads[name], g, rtol=1e-6, atol=1e-8, msg=name)


def test_blocks_are_found_and_a_model_without_blocks_is_refused():
    assert len(transformer_blocks(tiny_gpt2())) == 2
    assert len(transformer_blocks(_dit()[0])) == 2
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with pytest.raises(
        ValueError,
        match=r"Plan\(activation_checkpointing=True\) needs transformer blocks, but Sequential has none",
    ):
        tessera.boost(
            model, torch.optim.SGD(model.parameters(), lr=0.1), tessera.Plan(activation_checkpointing=True)
        )
