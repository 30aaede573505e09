"""What the parallel samplers do with each attention feature of the models they take
(docs/attention_inventory.md): a layer whose computation Tessera's processors would not
reproduce is refused by name before any step runs; conditioning an adapter would not read
is refused; the features the processors mirror (the prompt mask, residual connection,
output rescale, q/k norms) are checked to matter, so the parity tests could catch their loss.
All single-process, tiny models built from configs."""

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FluxTransformer2DModel, PixArtTransformer2DModel
from diffusers.models.attention_processor import (
    Attention,
    AttnProcessor,
    AttnProcessor2_0,
    PAGCFGIdentitySelfAttnProcessor2_0,
)
from parity import perturbed, relative_error
from test_diffusers_parity import inputs as pixart_inputs
from test_flux_parity import tiny_flux
from test_sd3_parity import tiny_sd3
from tiny_pipelines import tiny_pixart_transformer

from tessera.diffusion.adapters import serial_kernel
from tessera.diffusion.adapters.diffusers_common import KernelProcessor
from tessera.diffusion.adapters.flux import FluxDoubleProcessor
from tessera.diffusion.layout import ParallelConfig
from tessera.diffusion.parallel import parallel_denoise
from tessera.diffusion.stepper import DiffusersStepper
from tessera.models.dit import Attention as DiTAttention
from tessera.models.dit import DiT, DiTConfig


class NoSteps:
    """A stepper that fails if the sampler gets as far as a step: refusals come first."""

    num_steps = 1

    def model_time(self, step):
        raise AssertionError("a denoising step ran before the refusal")

    scale_input = step = model_time


def _joint_cond(guidance: bool = True) -> dict:
    g = torch.Generator().manual_seed(0)
    cond = {"prompt_embeds": torch.randn(1, 6, 24, generator=g), "pooled_prompt_embeds": torch.randn(1, 16)}
    return cond | {"guidance": torch.tensor([3.5])} if guidance else cond


def _pixart_cond() -> dict:
    return {"prompt_embeds": torch.randn(1, 5, 24), "prompt_attention_mask": torch.ones(1, 5)}


def _denoise(model, cond, config=None, height=16):
    config = config or ParallelConfig()
    noise = torch.randn(1, model.config.in_channels if isinstance(model, DiT) else 4, height, 12)
    return parallel_denoise(
        model, cond=cond, uncond=None, guidance_scale=1.0, stepper=NoSteps(), noise=noise, config=config
    )


class WindowedDiTAttention(DiTAttention):
    """A user's DiT attention with a local window: not the plain attention Tessera replaces."""


def _pixart_pag():
    model = tiny_pixart_transformer()
    model.transformer_blocks[1].attn1.set_processor(PAGCFGIdentitySelfAttnProcessor2_0())
    return model, _pixart_cond()


def _pixart_classic_processor():
    model = tiny_pixart_transformer()
    model.set_attn_processor(AttnProcessor())  # honours attn.scale and upcasting; 2_0 does not
    return model, _pixart_cond()


def _pixart_layer(**kwargs):
    def build():
        model = tiny_pixart_transformer()
        model.transformer_blocks[0].attn1 = Attention(query_dim=32, heads=4, dim_head=8, **kwargs)
        return model, _pixart_cond()

    return build


def _sd3_fused():
    model = tiny_sd3()
    model.fuse_qkv_projections()
    return model, _joint_cond(guidance=False)


def _flux_fused():
    model = tiny_flux()
    model.fuse_qkv_projections()
    return model, _joint_cond()


def _flux_backend():
    from diffusers.models.attention_dispatch import AttentionBackendName

    model = tiny_flux()
    # What model.set_attention_backend("sage") records (it first checks that sageattention
    # is installed, which it is not here).
    model.single_transformer_blocks[1].attn.processor._attention_backend = AttentionBackendName.SAGE
    return model, _joint_cond()


def _flux_diffusers_parallel():
    from diffusers import ContextParallelConfig

    model = tiny_flux()
    # What model.enable_parallelism(config=...) records before registering its hooks (it
    # needs an initialised process group, which a single-process test does not start).
    model._parallel_config = ContextParallelConfig(ring_degree=2)
    return model, _joint_cond()


def _flux_first_block_cache():
    from diffusers import FirstBlockCacheConfig

    model = tiny_flux()
    model.enable_cache(FirstBlockCacheConfig(threshold=0.2))  # reuses block outputs between steps
    return model, _joint_cond()


def _dit():
    torch.manual_seed(0)
    model = DiT(DiTConfig(image_size=16, in_channels=4, patch_size=2, hidden_size=32, depth=2, num_heads=4))
    return model, {"labels": torch.tensor([1])}


def _dit_windowed():
    model, cond = _dit()
    model.blocks[1].attn = WindowedDiTAttention(32, 4)
    return model, cond


REFUSED = {
    "pag_processor": (
        _pixart_pag,
        "transformer_blocks.1.attn1 runs processor PAGCFGIdentitySelfAttnProcessor2_0",
    ),
    "classic_processor": (
        _pixart_classic_processor,
        "transformer_blocks.0.attn1 runs processor AttnProcessor,",
    ),
    "cross_attention": (
        _pixart_layer(cross_attention_dim=24),
        "transformer_blocks.0.attn1 has cross-attention",
    ),
    "group_norm": (_pixart_layer(norm_num_groups=4), "transformer_blocks.0.attn1 has a group norm"),
    "spatial_norm": (_pixart_layer(spatial_norm_dim=4), "transformer_blocks.0.attn1 has a spatial norm"),
    "sd3_fused_qkv": (_sd3_fused, "transformer_blocks.0.attn has fused q/k/v projections"),
    "flux_fused_qkv": (_flux_fused, "transformer_blocks.0.attn has fused q/k/v projections"),
    "flux_backend": (_flux_backend, "single_transformer_blocks.1.attn uses attention backend 'sage'"),
    "diffusers_parallel": (_flux_diffusers_parallel, "FluxTransformer2DModel has diffusers' own parallelism"),
    "diffusers_cache": (
        _flux_first_block_cache,
        "transformer_blocks.0 carries diffusers hook 'fbc_leader_block_hook'",
    ),
    "dit_attention_class": (_dit_windowed, "blocks.1.attn is a WindowedDiTAttention, not tessera.models.dit"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_unmirrored_attention_layers_are_refused_by_name_before_sampling(case):
    build, message = REFUSED[case]
    model, cond = build()
    originals = [m.processor for m in model.modules() if hasattr(m, "processor")]
    for config in (ParallelConfig(), ParallelConfig(patches=2)):  # band samplers and PipeFusion
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as err:
            _denoise(model, cond, config)
        assert "\n" not in str(err.value)
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == originals


def _pixart_1024():
    model = PixArtTransformer2DModel(
        sample_size=128,  # the 1024-px models: the image size is a condition
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        in_channels=4,
        out_channels=8,
        cross_attention_dim=32,
        caption_channels=24,
        patch_size=2,
        norm_type="ada_norm_single",
        num_embeds_ada_norm=1000,
    ).eval()
    return model


def _flux_schnell():
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=24,
        pooled_projection_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(2, 2, 4),
    ).eval()


CONDITIONING = {
    "mask_under_another_name": (
        tiny_pixart_transformer,
        {"prompt_embeds": torch.randn(1, 5, 24), "encoder_attention_mask": torch.ones(1, 5)},
        "PixArt does not read conditioning 'encoder_attention_mask', which would be ignored",
    ),
    "image_size_missing": (
        _pixart_1024,
        _pixart_cond(),
        "PixArt needs conditioning resolution, aspect_ratio",
    ),
    "guidance_missing": (
        tiny_flux,
        _joint_cond(guidance=False),
        "Flux with a guidance embedding needs conditioning guidance",
    ),
    "guidance_unread": (
        _flux_schnell,
        _joint_cond(),
        r"Flux without a guidance embedding \(guidance_embeds=False\) does not read conditioning 'guidance'",
    ),
    "sd3_mask": (
        tiny_sd3,
        _joint_cond(guidance=False) | {"prompt_attention_mask": torch.ones(1, 6)},
        "SD3 does not read conditioning 'prompt_attention_mask'",
    ),
}


@pytest.mark.parametrize("case", CONDITIONING, ids=list(CONDITIONING))
def test_conditioning_an_adapter_would_not_read_is_refused(case):
    build, cond, message = CONDITIONING[case]
    with pytest.raises(ValueError, match="^" + message):
        _denoise(build(), cond)


def test_processor_calls_with_a_mask_are_refused_at_the_layer():
    """The adapters never pass masks to the layers they replace; a caller that does is told."""
    torch.manual_seed(0)
    attn = Attention(query_dim=32, heads=4, dim_head=8).eval()
    x, mask = torch.randn(1, 6, 32), torch.zeros(1, 1, 6)
    processor = KernelProcessor(0, serial_kernel, "transformer_blocks.3.attn1")
    with pytest.raises(ValueError, match="^transformer_blocks.3.attn1 was called with an attention mask"):
        processor(attn, x, attention_mask=mask)
    with pytest.raises(
        ValueError, match=r"^transformer_blocks.3.attn1 was called with encoder_hidden_states"
    ):
        processor(attn, x, encoder_hidden_states=x)
    flux = tiny_flux()
    double = FluxDoubleProcessor(0, serial_kernel, "transformer_blocks.0.attn")
    with pytest.raises(ValueError, match="^transformer_blocks.0.attn was called with an attention mask"):
        double(
            flux.transformer_blocks[0].attn, torch.randn(1, 4, 32), torch.randn(1, 2, 32), attention_mask=mask
        )


class WithoutResidualAndRescale:
    """The attention module as a processor that dropped the two features would see it."""

    def __init__(self, attn):
        self._attn = attn

    def __getattr__(self, name):
        return {"residual_connection": False, "rescale_output_factor": 1.0}.get(
            name, getattr(self._attn, name)
        )


def test_kernel_processor_mirrors_residual_rescale_and_qk_norm():
    """KernelProcessor against diffusers' AttnProcessor2_0 on a layer with every feature
    AttnProcessor2_0 reads for self-attention; the same processor blind to the residual and
    the rescale is far off, so this comparison would catch their loss."""
    torch.manual_seed(0)
    attn = perturbed(
        Attention(
            query_dim=32,
            heads=4,
            dim_head=8,
            qk_norm="rms_norm",
            residual_connection=True,
            rescale_output_factor=2.0,
        ),
        scale=0.3,
    )
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        expected = AttnProcessor2_0()(attn, x)
        got = KernelProcessor(0, serial_kernel)(attn, x)
        mutant = KernelProcessor(0, serial_kernel)(WithoutResidualAndRescale(attn), x)
    # Same ops on the same values in the same order (one SDPA call each): bit-equal in
    # practice; 1e-6 allows for a different SDPA kernel choice on another machine.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert (mutant - expected).abs().max() > 0.1  # the residual is O(1): x itself


def test_pixart_prompt_mask_reaches_the_cross_attention():
    """The prompt mask is honoured by the model's own cross-attention, which runs unchanged
    (test_pixart_layouts_match_the_pipeline_loop checks the serial latent bit-equal to the
    pipeline's loop, mask included). Dropping the mask moves the latent far beyond that
    check's tolerance, so the check would see a mask lost on the way."""
    data = pixart_inputs()
    model = tiny_pixart_transformer()

    def run(cond_mask):
        cond = {"prompt_embeds": data["text"]}
        uncond = {"prompt_embeds": data["negative"]}
        if cond_mask is not None:
            cond, uncond = (
                cond | {"prompt_attention_mask": cond_mask},
                uncond | {"prompt_attention_mask": cond_mask},
            )
        return parallel_denoise(
            model,
            cond=cond,
            uncond=uncond,
            guidance_scale=3.0,
            stepper=DiffusersStepper(DPMSolverMultistepScheduler(), 2),
            noise=data["noise"],
            config=ParallelConfig(),
        )

    masked, unmasked = run(data["mask"]), run(None)
    assert relative_error(unmasked, masked) > 1e-3  # 100x the exact layouts' 1e-5 tolerance


def test_tensor_parallel_baseline_refuses_what_its_plan_does_not_split():
    """Megatron TP leaves the model's own attention running on each rank's heads: Tessera's
    DiT, Wan and PixArt have a plan (SD3 has none), and the heads must divide the degree."""
    with pytest.raises(ValueError, match="^tensor parallel has no plan for SD3Transformer2DModel; it runs"):
        _denoise(tiny_sd3(), _joint_cond(guidance=False), ParallelConfig(tp=2))
    model, cond = _dit()
    with pytest.raises(ValueError, match="^4 attention heads are not divisible by the TP degree 3"):
        _denoise(model, cond, ParallelConfig(tp=3))


def test_a_latent_beyond_the_sd3_position_table_is_refused():
    """SD3 crops its position table to the image; a band takes its rows of that crop, which
    does not exist beyond pos_embed_max_size patches."""
    with pytest.raises(
        ValueError, match=r"^image size 34x12 exceeds this SD3 model's position table \(32x32\)"
    ):
        _denoise(tiny_sd3(), _joint_cond(guidance=False), height=34)
