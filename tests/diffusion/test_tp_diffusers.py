"""Tensor parallel on diffusers' DiTs (tessera.diffusion.tp_diffusers): Wan 2.1 on 2 ranks
equals the loop WanPipeline runs (and generate on the saved pipeline WanPipeline's frames),
LTX-Video and PixArt their pipelines' loops; a per-rank query/key norm (the mutant a plain
split of Wan's and LTX's norms across heads would be) fails the same tolerance; all-reduce
bytes equal the plan's count; split sizes the degree does not divide, fused q/k/v and a
LoRA variant (DoRA) are refused with their numbers before anything runs (a plain LoRA runs:
test_wan_lora)."""

import pytest
import torch
from parity import relative_error
from test_diffusers_parity import inputs as pixart_inputs
from test_diffusers_parity import pipeline_loop as pixart_loop
from test_diffusers_parity import tiny_pixart
from test_ltx_parity import _denoise as ltx_denoise
from test_ltx_parity import inputs as ltx_inputs
from test_ltx_parity import pipeline_loop as ltx_loop
from test_wan_parity import FRAMES, GUIDANCE, STEPS, H, W, inputs, pipeline_loop, scheduler
from tiny_ltx import tiny_ltx_transformer
from tiny_wan import build_wan_pipeline, tiny_wan_transformer
from torch import nn

import tessera.diffusion.tp_diffusers as tp_diffusers
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_denoise
from tessera.diffusion.stepper import DiffusersStepper
from tessera.runtime import spawn

TP2 = ParallelConfig(tp=2)
TOKENS, TEXT, HIDDEN, LAYERS = FRAMES * (H // 2) * (W // 2), 7, 24, 3  # tiny Wan's


def _wan(model, mesh, config: ParallelConfig = TP2) -> torch.Tensor:
    data, frames = inputs(), torch.tensor([FRAMES])
    return parallel_denoise(
        model,
        cond={"prompt_embeds": data["text"], "latent_frames": frames},
        uncond={"prompt_embeds": data["negative"], "latent_frames": frames},
        guidance_scale=GUIDANCE,
        stepper=DiffusersStepper(scheduler(), STEPS),
        noise=data["noise"].reshape(1, 4, FRAMES * H, W),
        config=config,
        mesh=mesh,
    )


def _pixart(model, mesh) -> torch.Tensor:
    from diffusers import DPMSolverMultistepScheduler
    from test_diffusers_parity import STEPS as PIXART_STEPS

    data = pixart_inputs()
    return parallel_denoise(
        model,
        cond={"prompt_embeds": data["text"], "prompt_attention_mask": data["mask"]},
        uncond={"prompt_embeds": data["negative"], "prompt_attention_mask": data["mask"]},
        guidance_scale=3.0,
        stepper=DiffusersStepper(DPMSolverMultistepScheduler(), PIXART_STEPS),
        noise=data["noise"],
        config=TP2,
        mesh=mesh,
    )


def _per_rank_norm(norm: nn.RMSNorm, group, rank: int, degree: int) -> nn.Module:
    """The mutant: each rank normalises its own heads' slice alone."""
    local = norm.normalized_shape[0] // degree
    mutant = nn.RMSNorm(local, eps=norm.eps)
    with torch.no_grad():
        mutant.weight.copy_(norm.weight[rank * local : (rank + 1) * local])
    return mutant


VIDEO = dict(prompt="a red cat", num_steps=2, guidance_scale=GUIDANCE, height=32, width=16, num_frames=5)


def _norms(mesh) -> dict:
    """HeadSplitRMSNorm on this rank's half of the width against its half of the whole
    torch RMSNorm, in float32 and bfloat16 (eps given and None)."""
    group = mesh.device_mesh["tp"]
    rank, g = group.get_local_rank(), torch.Generator().manual_seed(5)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for eps in (1e-6, None):
            norm = nn.RMSNorm(24, eps=eps).to(dtype)
            with torch.no_grad():
                norm.weight.copy_(torch.randn(24, generator=g))
            x = (torch.randn(2, 5, 24, generator=g) * 3).to(dtype)
            half = slice(12 * rank, 12 * (rank + 1))
            split = tp_diffusers.HeadSplitRMSNorm(norm, group, rank, 2)(x[..., half])
            out[(dtype, eps)] = (split, norm(x)[..., half])
    return out


def _worker(folder) -> dict:
    from tessera.diffusion.pipelines import generate, load_pipeline

    mesh = TP2.build_mesh()
    norms = _norms(mesh)
    pipe = load_pipeline(folder)  # the saved pipeline, as `tessera generate --tp 2` loads it
    pipe.set_progress_bar_config(disable=True)
    video = generate(pipe, **VIDEO, seed=3, config=TP2, mesh=mesh, output_type="pt")
    torch.manual_seed(0)
    model = tiny_wan_transformer()
    mesh.comm.ledger.reset()
    wan = _wan(model, mesh)
    counted = mesh.comm.ledger.snapshot()
    attn = model.blocks[0].attn1
    restored = (
        attn.heads == 2
        and type(attn.norm_q) is nn.RMSNorm
        and not any(hasattr(p, "placements") for p in model.parameters())
    )
    ltx = ltx_denoise({"tp2": TP2})["tp2"]
    # the mutant, put back after: a pooled rank process runs other tests' work next
    tp_diffusers._split_norm, exact = _per_rank_norm, tp_diffusers._split_norm
    try:
        mutant = _wan(model, mesh)
        ltx_mutant = ltx_denoise({"tp2": TP2})["tp2"]
    finally:
        tp_diffusers._split_norm = exact
    return dict(
        norms=norms,
        video=video,
        wan=wan,
        counted=counted,
        restored=restored,
        mutant=mutant,
        ltx=ltx,
        ltx_mutant=ltx_mutant,
        pixart=_pixart(tiny_pixart(), mesh),
    )


def test_tensor_parallel_on_wan_ltx_and_pixart_matches_their_pipelines(tmp_path):

    from tessera.diffusion.pipelines import load_pipeline

    folder = build_wan_pipeline(tmp_path / "wan")
    pipe = load_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    run = {k: v for k, v in VIDEO.items() if k not in ("num_steps",)}
    reference = pipe(
        **run, num_inference_steps=2, generator=torch.Generator().manual_seed(3), output_type="pt"
    ).frames[0]
    torch.manual_seed(0)
    expected = pipeline_loop(tiny_wan_transformer(), inputs())
    pixart_expected = pixart_loop(tiny_pixart(), pixart_inputs())
    torch.manual_seed(0)
    ltx_expected = ltx_loop(tiny_ltx_transformer(), ltx_inputs())
    # per rank, per step, both guidance branches (2 samples): the three rowwise all-reduces of
    # each layer (self-attention, cross-attention, MLP outputs: tokens x hidden) and the
    # sum-of-squares all-reduces of the query/key norms (self q and k over the video's tokens,
    # cross q over them and k over the prompt's), float32
    per_layer = 3 * TOKENS * HIDDEN + 3 * TOKENS + TEXT
    formula = STEPS * LAYERS * 2 * per_layer * 4
    ranks = spawn(_worker, 2, str(folder), timeout_s=300)
    # WanPipeline's own frames (two branch calls, a serial VAE decode) vs generate under tp=2
    # (the same decode): float32 rounding (measured 1.0e-6)
    torch.testing.assert_close(ranks[0]["video"], reference, rtol=0, atol=1e-5)
    assert ranks[1]["video"] is None  # the frames come back on rank 0
    print(f"tp=2 generate vs WanPipeline: max |frame diff| {(ranks[0]['video'] - reference).abs().max():.1e}")
    for rank in ranks:
        for (dtype, eps), (split, whole) in rank["norms"].items():
            # the sum of squares in two partial sums: float32 rounding (measured 4.8e-7 on
            # values up to ~3), at most one bfloat16 rounding step (2^-8) where it tips a cast
            # (measured: bfloat16 equal)
            tol = 1e-6 if dtype == torch.float32 else 2**-8
            torch.testing.assert_close(split, whole, rtol=tol, atol=tol, msg=f"{dtype} eps={eps}")
            print(f"split norm vs torch's, {dtype} eps={eps}: max |diff| {(split - whole).abs().max():.1e}")
        # the same math with the attention and MLP sums split over 2 ranks: float32 rounding
        # (~1e-7 relative per op) through 3 layers, 3-4 steps and guidance 3-4 (measured
        # 3.1e-7 Wan, 2.3e-7 LTX, 2.8e-7 PixArt): a 30x margin
        errors = {
            name: relative_error(rank[name], exact)
            for name, exact in (
                ("wan", expected),
                ("ltx", ltx_expected),
                ("pixart", pixart_expected),
                ("mutant", expected),
                ("ltx_mutant", ltx_expected),
            )
        }
        print("tp=2 relative error:", ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        assert max(errors["wan"], errors["ltx"], errors["pixart"]) < 1e-5, errors
        # a per-rank query/key norm is another model (measured 4.9e-2 Wan, 2.7e-2 LTX):
        # 100x past the tolerance
        assert min(errors["mutant"], errors["ltx_mutant"]) > 1e-3, errors
        assert rank["restored"]  # heads, norms and whole weights back after the run
        assert rank["counted"].keys() == {"all_reduce@tp"}, rank["counted"]
        assert rank["counted"]["all_reduce@tp"]["bytes"] == formula


def test_split_sizes_the_degree_does_not_divide_are_refused(tmp_path, capsys):
    from diffusers import WanTransformer3DModel

    from tessera import cli
    from tessera.diffusion.adapters import adapter_for
    from tessera.diffusion.parallel import check_layout

    def wan(**kw):
        with torch.device("meta"):
            config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4)
            return WanTransformer3DModel(**config | dict(text_dim=24, freq_dim=16, num_layers=1) | kw)

    with pytest.raises(ValueError, match="^2 attention heads are not divisible by the TP degree 3$"):
        check_layout(adapter_for(wan(ffn_dim=32)), ParallelConfig(tp=3), 8, 8)
    with pytest.raises(
        ValueError,
        match=r"^tp=2 does not divide the output features \(33\) of module 'blocks.0.ffn.net.0.proj'$",
    ):
        check_layout(adapter_for(wan(ffn_dim=33)), TP2, 8, 8)
    model = wan(ffn_dim=32)
    model.blocks[0].attn1.fuse_projections()
    with pytest.raises(ValueError, match=r"^blocks.0.attn1 has fused q/k/v projections"):
        check_layout(adapter_for(model), TP2, 8, 8)
    from diffusers import LTXVideoTransformer3DModel

    with torch.device("meta"):
        ltx = LTXVideoTransformer3DModel(
            in_channels=8, num_attention_heads=2, attention_head_dim=12, num_layers=1, activation_fn="geglu"
        )
    with pytest.raises(ValueError, match=r"^transformer_blocks.0.ff uses activation GEGLU; tensor parallel"):
        check_layout(adapter_for(ltx), TP2, 8, 8)
    from peft import LoraConfig

    model = wan(ffn_dim=32)
    model.add_adapter(LoraConfig(r=2, target_modules=["to_q"]))  # what load_lora_weights does
    check_layout(adapter_for(model), TP2, 8, 8)  # a plain LoRA: merged into the split Linear
    assert hasattr(model.blocks[0].attn1.to_q, "base_layer")  # the LoRA layer is back after the check
    model = wan(ffn_dim=32)
    model.add_adapter(LoraConfig(r=2, target_modules=["to_q"], use_dora=True))
    with pytest.raises(ValueError, match=r"^blocks.0.attn1.to_q: adapter 'default' is a LoRA variant"):
        check_layout(adapter_for(model), TP2, 8, 8)

    # the command line refuses them before any rank starts
    folder = build_wan_pipeline(tmp_path / "wan")
    argv = ["generate", "--model", str(folder), "--prompt", "a cat", "--height", "32", "--width", "16"]
    assert cli.main(argv + ["--frames", "3", "--nproc", "3", "--tp", "3"]) == 2
    assert "2 attention heads are not divisible by the TP degree 3" in capsys.readouterr().err


TP2_CFG = ParallelConfig(tp=2, cfg_parallel=True)


def _four_ranks() -> torch.Tensor:
    torch.manual_seed(0)
    return _wan(tiny_wan_transformer(), TP2_CFG.build_mesh(), TP2_CFG)


def test_tensor_parallel_with_cfg_parallel_on_four_ranks():
    """tp=2 inside each of the two guidance branches (4 ranks): every rank returns the
    pipeline loop's latent, within the same float32 tolerance as on 2 ranks (by hand before:
    2.9e-7)."""
    torch.manual_seed(0)
    expected = pipeline_loop(tiny_wan_transformer(), inputs())
    for rank, latent in enumerate(spawn(_four_ranks, 4, timeout_s=300)):
        error = relative_error(latent, expected)
        print(f"tp=2 x cfg on 4 ranks, rank {rank}: relative error {error:.1e}")
        assert error < 1e-5, (rank, error)  # float32 rounding of the split sums, as on 2 ranks
