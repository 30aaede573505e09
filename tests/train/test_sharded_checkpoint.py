"""Sharded checkpoints (torch.distributed.checkpoint's format): saved at dp2 x tp2 (ZeRO-2,
GPT-2's TP layout), loaded in one process and back, bit-exact; read by plain torch DCP code
and the reverse; training continues identically; crashes and foreign checkpoints.

Tolerance: a checkpoint stores the bits it is given and a load places them back, whatever the
plan, so every save/load comparison is exact (rtol=0, atol=0). Only training on after a load
under another plan sums gradients in another order (fp32 rounding, ~1e-7 relative a step):
that next step is compared at rtol 1e-5 (loss) and rtol 1e-4 / atol 1e-5 (parameters after
Adam, whose division by sqrt(v) can magnify an element's rounding), as in test_boost_parity.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiny_lm import SEQ, VOCAB, tiny_gpt2, tiny_llama
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_state_dict

import tessera
from tessera.runtime import spawn
from tessera.train import sharded_checkpoint as sc
from tessera.train.checkpoint import CheckpointError
from tessera.train.export import full_state_dict
from tessera.train.losses import causal_lm_loss


def _batch(i):
    return torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(10 + i))


def _boosted(plan):
    model = tiny_gpt2()
    return tessera.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4), plan)


def _local_snapshot(model, opt):
    """Everything this rank holds: local parameter pieces and optimizer state tensors."""
    engine = opt.engine
    out = {
        f"p:{n}": (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    for i, shard in enumerate(engine.shards):
        for k, v in engine.optimizer.state[shard].items():
            out[f"s{i}:{k}"] = v.clone()
    return out


def _save_worker(folder):
    model, opt = _boosted(tessera.Plan(dp=2, tp=2, zero=2))
    for i in range(2):
        opt.train_step(_batch(i), causal_lm_loss)
    sc.save_sharded(model, opt, folder)
    snapshot, full, optim = _local_snapshot(model, opt), full_state_dict(model, opt), opt.state_dict()
    next_loss = opt.train_step(_batch(2), causal_lm_loss)["loss"]
    return snapshot, full, next_loss, full_state_dict(model, opt), optim


def _reload_worker(folder):
    model, opt = _boosted(tessera.Plan(dp=2, tp=2, zero=2))
    sc.load_sharded(model, opt, folder)
    return _local_snapshot(model, opt)


def test_save_at_dp2_tp2_load_in_one_process_and_back(tmp_path):
    first, second = tmp_path / "dp2xtp2", tmp_path / "dp1"
    saved = spawn(_save_worker, 4, str(first))
    snapshots = [s[0] for s in saved]
    full, next_loss, full_after, optim = saved[0][1], saved[0][2], saved[0][3], saved[0][4]

    # plain torch, one process, DCP's own loader: every tensor whole under its usual name
    plain = tiny_gpt2()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=1e-4)
    state = {"model": plain.state_dict(), "optimizer": get_optimizer_state_dict(plain, plain_opt)}
    dcp.load(state, checkpoint_id=first, no_dist=True)
    set_state_dict(plain, plain_opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), full[name], rtol=0, atol=0, msg=name)  # bit-exact
    for i, entry in optim["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(plain_opt.state_dict()["state"][i][key], value, rtol=0, atol=0)
    loss = causal_lm_loss(plain, _batch(2))
    loss.backward()
    plain_opt.step()
    assert loss.item() == pytest.approx(next_loss, rel=1e-5)  # sums in another order: fp32 rounding

    model, opt = _boosted(tessera.Plan())  # one process: no tensor parallel layout, no sharding
    meta = sc.load_sharded(model, opt, first)
    assert meta["plan"]["tp"] == 2 and meta["world"] == 4
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), full[name], rtol=0, atol=0, msg=name)  # bit-exact
    # training goes on as it did on four ranks (sums in another order: fp32 rounding only)
    assert opt.train_step(_batch(2), causal_lm_loss)["loss"] == pytest.approx(next_loss, rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), full_after[name], rtol=1e-4, atol=1e-5, msg=name)

    model, opt = _boosted(tessera.Plan())
    sc.load_sharded(model, opt, first)
    sc.save_sharded(model, opt, second)
    reloaded = spawn(_reload_worker, 4, str(second))
    for rank, (before, after) in enumerate(zip(snapshots, reloaded, strict=True)):
        assert before.keys() == after.keys()
        for key in before:
            torch.testing.assert_close(after[key], before[key], rtol=0, atol=0, msg=f"rank {rank} {key}")


def test_zero3_and_offload_round_trip_in_one_process(tmp_path):
    """ZeRO-3, and ZeRO-3 with chunks offloaded to disk (a host budget of a few chunks), saved
    and loaded into a plain plan and back into the offloaded one: bit-exact."""
    offload = dict(
        zero=3, chunk_mib=0.02, offload="static", host_memory=200_000, offload_dir=str(tmp_path / "disk")
    )
    for name, plan in (("z3", dict(zero=3, chunk_mib=0.01)), ("offload", offload)):
        model, opt = _boosted(tessera.Plan(**plan))
        opt.train_step(_batch(0), causal_lm_loss)
        sc.save_sharded(model, opt, tmp_path / name)
        expected, expected_optim = full_state_dict(model, opt), opt.state_dict()
        for back in (dict(), plan):
            model2, opt2 = _boosted(tessera.Plan(**back))
            sc.load_sharded(model2, opt2, tmp_path / name)
            got, got_optim = full_state_dict(model2, opt2), opt2.state_dict()
            for key, value in expected.items():
                torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{name} -> {back}: {key}")
            for i, entry in expected_optim["state"].items():
                for key, value in entry.items():
                    torch.testing.assert_close(got_optim["state"][i][key], value, rtol=0, atol=0)


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = _boosted(tessera.Plan())
    sc.save_sharded(model, opt, tmp_path / "ckpt")
    before = full_state_dict(model, opt)
    opt.train_step(_batch(0), causal_lm_loss)

    class FullDisk(sc.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError("disk full")

    monkeypatch.setattr(sc, "FileSystemWriter", FullDisk)
    with pytest.raises(OSError, match="disk full"):
        sc.save_sharded(model, opt, tmp_path / "ckpt")
    monkeypatch.undo()
    fresh, fresh_opt = _boosted(tessera.Plan())
    sc.load_sharded(fresh, fresh_opt, tmp_path / "ckpt")
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)


def test_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    model, opt = _boosted(tessera.Plan())
    sc.save_sharded(model, opt, tmp_path / "gpt2")
    wider = tiny_gpt2(width=64)
    wider, wider_opt = tessera.boost(wider, torch.optim.AdamW(wider.parameters()), tessera.Plan())
    with pytest.raises(
        CheckpointError, match=r"is from a different model: parameters differ at \['transformer.wte.weight'"
    ):
        sc.load_sharded(wider, wider_opt, tmp_path / "gpt2")
    llama = tiny_llama(layers=1)
    llama, llama_opt = tessera.boost(llama, torch.optim.AdamW(llama.parameters()), tessera.Plan())
    with pytest.raises(CheckpointError, match="holds a GPT2LMHeadModel, not a LlamaForCausalLM"):
        sc.load_sharded(llama, llama_opt, tmp_path / "gpt2")
    with pytest.raises(CheckpointError, match="no checkpoint at .*nothing: the folder does not exist"):
        sc.load_sharded(model, opt, tmp_path / "nothing")


def _continue_worker(folder, plan_kwargs):
    model, opt = _boosted(tessera.Plan(**plan_kwargs))
    sc.load_sharded(model, opt, folder)
    return opt.train_step(_batch(2), causal_lm_loss)["loss"], full_state_dict(model, opt)


def test_load_into_other_plans_continues_the_same_training(tmp_path):
    """Saved at dp2 x tp2 (ZeRO-2), resumed at dp2 ZeRO-3, tp2 ZeRO-1 and dp2 x tp2 ZeRO-3: the
    next step gives the loss and parameters the original run got (fp32 rounding only)."""
    folder = tmp_path / "ckpt"
    _, _, next_loss, full_after, _ = spawn(_save_worker, 4, str(folder))[0]
    for plan_kwargs in (dict(dp=2, zero=3, chunk_mib=0.01), dict(tp=2, zero=1), dict(dp=2, tp=2, zero=3)):
        ranks = plan_kwargs.get("dp", 1) * plan_kwargs.get("tp", 1)
        loss, params = spawn(_continue_worker, ranks, str(folder), plan_kwargs)[0]
        assert loss == pytest.approx(next_loss, rel=1e-5), plan_kwargs
        for name, ref in full_after.items():
            if name in params:
                torch.testing.assert_close(
                    params[name], ref, rtol=1e-4, atol=1e-5, msg=f"{plan_kwargs} {name}"
                )


def _with_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    return model


def _build_with_scheduler():
    model = _with_dropout(tiny_gpt2())
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: min(1.0, (step + 1) / 4))
    model, opt = tessera.boost(model, inner, tessera.Plan(dp=2, zero=2, chunk_mib=0.005))
    return model, opt, scheduler


def _step(model, opt, scheduler, i):
    loss = opt.train_step(_batch(i), causal_lm_loss)["loss"]
    scheduler.step()
    return loss


def _resume_worker(folder):
    rank = torch.distributed.get_rank()
    model, opt, scheduler = _build_with_scheduler()
    torch.manual_seed(100 + rank)  # each rank draws its own dropout masks
    for i in range(2):
        _step(model, opt, scheduler, i)
    sc.save_sharded(model, opt, folder, scheduler=scheduler)
    lr = opt.param_groups[0]["lr"]
    loss = _step(model, opt, scheduler, 2)
    want = full_state_dict(model, opt)
    out = {}
    for restore_rng in (True, False):
        model, opt, scheduler = _build_with_scheduler()  # seeds the RNG anew
        meta = sc.load_sharded(model, opt, folder, scheduler=scheduler)
        if not restore_rng:
            torch.manual_seed(100 + rank)  # the RNG as a fresh run would have it
        same_lr = opt.param_groups[0]["lr"] == lr and scheduler.last_epoch == 2
        got_loss = _step(model, opt, scheduler, 2)
        got = full_state_dict(model, opt)
        out[restore_rng] = (
            meta["rng_restored"],
            same_lr,
            got_loss == loss,
            all(torch.equal(got[n], want[n]) for n in want),
        )
    return out


def test_resume_restores_scheduler_lr_and_rng_and_takes_the_same_next_step(tmp_path):
    """Dropout on, an LR warm-up, dp2 ZeRO-2: the step after loading equals, to the bit, the
    step the original run took; without the saved RNG states the dropout masks (and so the
    step) differ — the check can fail."""
    for out in spawn(_resume_worker, 2, str(tmp_path / "ckpt")):
        assert out[True] == (True, True, True, True)
        restored, same_lr, same_loss, same_params = out[False]
        assert same_lr and not same_loss and not same_params


def test_missing_pieces_and_files_are_named(tmp_path):
    import pickle

    model, opt = _boosted(tessera.Plan(zero=3, chunk_mib=0.005))
    opt.train_step(_batch(0), causal_lm_loss)
    folder = sc.save_sharded(model, opt, tmp_path / "ckpt")
    whole = (folder / ".metadata").read_bytes()
    md = sc.FileSystemReader(folder).read_metadata()
    wpe = md.state_dict_metadata["model.transformer.wpe.weight"]
    lost = wpe.chunks.pop()  # as if the rank that wrote this box had not
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    fresh, fresh_opt = _boosted(tessera.Plan())
    with pytest.raises(
        CheckpointError,
        match=rf"does not cover every tensor: missing transformer.wpe.weight \({lost.sizes.numel()} elements\)",
    ):
        sc.load_sharded(fresh, fresh_opt, folder)
    target = "transformer.h.1.mlp.c_fc.weight"
    md = pickle.loads(whole)
    del md.state_dict_metadata[f"model.{target}"]
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=rf"missing {target} \(no pieces\)"):
        sc.load_sharded(fresh, fresh_opt, folder)
    (folder / ".metadata").write_bytes(whole)
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"is incomplete: __0_0.distcp is missing \(it holds 1 files\)"):
        sc.load_sharded(fresh, fresh_opt, folder)
    (folder / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"not a complete checkpoint: DCP's .metadata is missing"):
        sc.load_sharded(fresh, fresh_opt, folder)


def _from_plain_torch_worker(folder):
    model, opt = _boosted(tessera.Plan(tp=2, zero=1))
    meta = sc.load_sharded(model, opt, folder)
    full, optim = full_state_dict(model, opt), opt.state_dict()
    lr = opt.param_groups[0]["lr"]
    return meta["format"], full, optim, opt.train_step(_batch(2), causal_lm_loss)["loss"], lr


def test_a_checkpoint_plain_torch_wrote_loads_under_a_plan(tmp_path):
    """Plain torch on one process trains two steps and saves with DCP as its users do; two
    ranks at tp2 ZeRO-1 (GPT-2's TP layout) load it: parameters and Adam's states to the bit,
    the groups' hyper-parameters (an lr a scheduler set) as saved."""
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    for i in range(2):
        causal_lm_loss(model, _batch(i)).backward()
        opt.step()
        opt.zero_grad()
    opt.param_groups[0]["lr"] = 3e-3  # as an LR scheduler would have set it
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=tmp_path / "plain", no_dist=True)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    want_optim = opt.state_dict()
    next_loss = causal_lm_loss(model, _batch(2)).item()
    for fmt, full, optim, loss, lr in spawn(_from_plain_torch_worker, 2, str(tmp_path / "plain")):
        assert fmt == "torch-dcp" and lr == 3e-3  # the group's hyper-parameters too
        for name, value in want.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
        for i, entry in want_optim["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(optim["state"][i][key], value, rtol=0, atol=0, msg=f"{i} {key}")
        assert loss == pytest.approx(next_loss, rel=1e-5)  # tp sums in another order: fp32 rounding


def _expert_worker(folder):
    """Saved at dp2 x ep2 ZeRO-1 (each ep rank writes its own experts: dp rank 1 too), loaded
    back at dp2 x ep2 ZeRO-3 and at dp2 ZeRO-2 without expert parallelism (ep 2 -> 1)."""
    from tiny_moe import SEQ as MOE_SEQ
    from tiny_moe import VOCAB as MOE_VOCAB
    from tiny_moe import tiny_moe

    def boosted(**plan):
        model = tiny_moe("mixtral")
        return tessera.boost(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4), tessera.Plan(**plan)
        )

    batch = torch.randint(0, MOE_VOCAB, (8, MOE_SEQ), generator=torch.Generator().manual_seed(4))
    model, opt = boosted(dp=2, ep=2, zero=1)
    opt.train_step(batch, causal_lm_loss)
    sc.save_sharded(model, opt, folder)
    saved = full_state_dict(model, opt), opt.state_dict()
    loaded = []
    for plan in (dict(dp=2, ep=2, zero=3, chunk_mib=0.01), dict(dp=2, zero=2)):
        model, opt = boosted(**plan)
        sc.load_sharded(model, opt, folder)
        loaded.append((full_state_dict(model, opt), opt.state_dict()))
    return saved, loaded


def test_expert_parallel_checkpoints_reshard_across_ep_degrees(tmp_path):
    from tiny_moe import tiny_moe

    (want, want_optim), loaded = spawn(_expert_worker, 2, str(tmp_path / "ep"))[0]
    model = tiny_moe("mixtral")
    model, opt = tessera.boost(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4), tessera.Plan()
    )
    sc.load_sharded(model, opt, tmp_path / "ep")  # and in one process
    loaded.append((full_state_dict(model, opt), opt.state_dict()))
    for got, got_optim in loaded:
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)  # bit-exact
        for i, entry in want_optim["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(
                    got_optim["state"][i][key], value, rtol=0, atol=0, msg=f"{i} {key}"
                )
