"""Parallel VAE decode (rows split over ranks, halo exchange, norms reduced over ranks) and
chunked convolution: equal to diffusers' own AutoencoderKL.decode, bytes as the formula
says, a per-rank norm caught, and the activation peak per rank measured."""

import pytest
import torch
from parity import perturbed, relative_error
from tiny_pipelines import build_pixart_pipeline

from tessera.diffusion.vae_parallel import VaeSplit, decode_rows, halo_bytes
from tessera.memory.track import TensorMemory
from tessera.runtime import spawn

# Parallel and chunked decodes reorder float32 sums (group-norm statistics in float64 over
# bands, convolutions over row pieces): measured relative errors ~1e-6 against
# AutoencoderKL.decode on the random tiny VAEs; 1e-5 leaves a 10x margin. A per-rank norm
# is measured >1e-2 away, far outside it.
TOLERANCE = 1e-5


def tiny_vae(channels=(8, 16), groups=4, seed=0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    n = len(channels)
    return perturbed(
        AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=channels,
            down_block_types=("DownEncoderBlock2D",) * n,
            up_block_types=("UpDecoderBlock2D",) * n,
            layers_per_block=1,
            norm_num_groups=groups,
            sample_size=32,
        )
    )


def latent(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


SMALL = (2, 4, 7, 6)  # 7 latent rows over 2 ranks: bands of 4 and 3; a batch of 2
WIDE = ((32, 32, 32), (1, 4, 16, 16))  # the memory case: three levels, a 64 x 64 image


def _ranks(pipeline_dir):
    from tessera.diffusion.layout import ParallelConfig
    from tessera.diffusion.pipelines import generate, load_pipeline
    from tessera.runtime.mesh import Mesh

    mesh = Mesh(vae=2)
    vae, z = tiny_vae(), latent(SMALL)
    out = {}
    mesh.comm.ledger.reset()
    out["whole"] = decode_rows(vae, z, VaeSplit(mesh=mesh))
    out["sent"] = mesh.comm.ledger.total(op="send")
    out["reduces"] = mesh.comm.ledger.count(op="all_reduce")
    out["chunked"] = decode_rows(vae, z, VaeSplit(mesh=mesh, chunk_rows=3))
    out["per_rank_norm"] = decode_rows(vae, z, VaeSplit(mesh=mesh, reduce_norm=False))
    with pytest.raises(ValueError, match="latent of 1 rows cannot be split over 2 ranks"):
        decode_rows(vae, z[:, :, :1], VaeSplit(mesh=mesh))
    wide = tiny_vae(WIDE[0], groups=8)
    for chunk_rows in (None, 8):
        with TensorMemory() as mem:
            decode_rows(wide, latent(WIDE[1]), VaeSplit(mesh=mesh, chunk_rows=chunk_rows))
        out[f"peak_{chunk_rows}"] = mem.peak
    wan, z_wan = wan_vae(), latent(WAN_LATENT)
    mesh.comm.ledger.reset()
    out["wan"] = decode_rows(wan, z_wan, VaeSplit(mesh=mesh))
    out["wan_gathers"] = mesh.comm.ledger.count(op="all_gather")
    with TensorMemory() as mem:
        decode_rows(wan, latent(WAN_WIDE), VaeSplit(mesh=mesh))
    out["wan_peak"] = mem.peak
    out["ltx"] = decode_rows(ltx_vae(), latent(LTX_LATENT), VaeSplit(mesh=mesh))
    # through generate: the saved PixArt pipeline, Ulysses over 2 ranks, the VAE split too
    pipe = load_pipeline(pipeline_dir, with_text_encoder=mesh.global_rank == 0)
    run = dict(prompt="a red cat", height=32, width=24, num_steps=2, guidance_scale=4.5, seed=3)
    out["image"] = generate(
        pipe, config=ParallelConfig(ulysses=2), output_type="pt", parallel_vae=True, **run
    )
    return out


@pytest.fixture(scope="module")
def pixart(tmp_path_factory):
    return build_pixart_pipeline(tmp_path_factory.mktemp("pixart"))


def test_parallel_decode_equals_serial(pixart):
    from tessera.diffusion.layout import ParallelConfig
    from tessera.diffusion.pipelines import generate, load_pipeline

    vae, z = tiny_vae(), latent(SMALL)
    with torch.no_grad():
        serial = vae.decode(z).sample
    ranks = spawn(_ranks, 2, pixart, timeout_s=300)
    assert ranks[1]["whole"] is None and ranks[1]["image"] is None  # the image lands on rank 0
    for name in ("whole", "chunked"):
        assert relative_error(ranks[0][name], serial) < TOLERANCE, name
    # A norm over each band alone is a different model: the same comparison fails it.
    assert relative_error(ranks[0]["per_rank_norm"], serial) > 100 * TOLERANCE
    # Halo rows to each neighbour, as the formula says; rank 1 also sends its band of the
    # image (3 channels x 8 rows x 12 columns x batch 2, float32) to rank 0.
    assert ranks[0]["sent"] == halo_bytes(vae, SMALL, rank=0, ranks=2)
    assert ranks[1]["sent"] == halo_bytes(vae, SMALL, rank=1, ranks=2) + 2 * 3 * 6 * 12 * 4
    # one all-reduce per group norm: 2 per resnet (2 mid + 2 x 2 up), the attention's, the last
    assert ranks[0]["reduces"] == 2 * (2 + 4) + 1 + 1
    # Chunked on one device (3 output rows at a time) is the same decode too.
    assert relative_error(decode_rows(vae, z, VaeSplit(chunk_rows=3)), serial) < TOLERANCE

    # Activation peak per rank against the serial decode's (live tensor bytes the decode
    # adds, at ATen level): the band's maps are half the image's, plus halos, the
    # mid-block's gathered K/V and rank 0's whole output image.
    wide, z_wide = tiny_vae(WIDE[0], groups=8), latent(WIDE[1])
    with torch.no_grad(), TensorMemory() as mem:
        wide.decode(z_wide)
    serial_peak = mem.peak
    with TensorMemory() as mem:
        decode_rows(wide, z_wide, VaeSplit(chunk_rows=8))
    chunked_peak = mem.peak
    ratios = {c: [round(r[f"peak_{c}"] / serial_peak, 3) for r in ranks] for c in (None, 8)}
    print(f"VAE peak / serial: 2 ranks {ratios}, chunked one device {chunked_peak / serial_peak:.3f}")
    assert max(ratios[None]) <= 1.2 / 2, ratios  # the aim: at most 1.2 / N of serial
    assert max(ratios[8]) < max(ratios[None]), ratios  # chunks compose with the split
    # measured 0.694 here (0.719 in the bench's larger case): 0.8 says chunking cuts the peak
    # by a fifth at least, with room for allocator rounding on another machine
    assert chunked_peak < 0.8 * serial_peak, chunked_peak / serial_peak

    # Wan's causal 3-D VAE, rows split (its own frame-by-frame decode and caches per band)
    wan, z_wan = wan_vae(), latent(WAN_LATENT)
    with torch.no_grad(), TensorMemory() as mem:
        serial_wan = wan.decode(z_wan).sample
        wan.decode(latent(WAN_WIDE))
    assert ranks[1]["wan"] is None
    assert relative_error(ranks[0]["wan"], serial_wan) < TOLERANCE
    assert ranks[0]["wan_gathers"] == 2 * WAN_LATENT[2]  # the mid-block's K and V, each latent frame
    wan_ratios = [round(r["wan_peak"] / mem.peak, 3) for r in ranks]
    print(f"Wan VAE peak / serial, 2 ranks: {wan_ratios}")
    assert max(wan_ratios) <= 1.2 / 2, wan_ratios

    # LTX-Video's 3-D VAE, rows split (no attention; depth-to-space upsampling is row-local)
    with torch.no_grad():
        serial_ltx = ltx_vae().decode(latent(LTX_LATENT), None).sample
    assert relative_error(ranks[0]["ltx"], serial_ltx) < TOLERANCE

    # The pipeline's image with a split VAE equals the serial VAE's.
    pipe = load_pipeline(pixart)
    reference = generate(
        pipe,
        prompt="a red cat",
        height=32,
        width=24,
        num_steps=2,
        guidance_scale=4.5,
        seed=3,
        config=ParallelConfig(),
        output_type="pt",
    )
    # through the pipeline's postprocess (images in [0, 1]): under an 8-bit grey level
    torch.testing.assert_close(ranks[0]["image"], reference, rtol=0, atol=1e-4)


def test_unknown_vae_class_is_refused_by_name():
    from diffusers import AutoencoderTiny

    vae = AutoencoderTiny(
        encoder_block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        num_encoder_blocks=(1,),
        num_decoder_blocks=(1,),
        latent_channels=4,
    )
    with pytest.raises(
        ValueError,
        match="VAE class AutoencoderTiny is not supported; supported: AutoencoderKL, AutoencoderKLWan, AutoencoderKLLTXVideo",
    ):
        decode_rows(vae, latent((1, 4, 4, 4)), VaeSplit())
    tiled = tiny_vae()
    tiled.enable_tiling()
    with pytest.raises(ValueError, match="tiling enabled"):
        decode_rows(tiled, latent((1, 4, 4, 4)), VaeSplit())
    with pytest.raises(ValueError, match="chunk_rows must be an integer >= 1"):
        VaeSplit(chunk_rows=0)


def test_a_frame_split_is_refused_with_its_reason():
    # Wan's causal decode: a frame's output depends on the frames before it (the caches), so
    # decoding the last latent frames alone is a different video, and passing the caches on
    # would make rank r+1 wait for rank r: refused, pointing at the rows split.
    vae, z = wan_vae(), latent(WAN_LATENT)
    with torch.no_grad():
        serial = vae.decode(z, return_dict=False)[0]
        alone = vae.decode(z[:, :, 1:], return_dict=False)[0]  # latent frames 1-2 with fresh caches
    # the last latent frame's two video frames: measured 1.31 relative apart (a decode that did not
    # depend on earlier frames would match to float32 rounding, ~1e-6)
    assert relative_error(alone[:, :, -2:], serial[:, :, -2:]) > 0.05
    refusals = {
        "Wan": (vae, "a frame split of AutoencoderKLWan is refused: its causal decode runs frame by frame"),
        "LTX": (ltx_vae(), "a frame split of AutoencoderKLLTXVideo is not implemented; split by rows"),
        "KL": (tiny_vae(), "AutoencoderKL decodes images, which have no frames to split; split by rows"),
    }
    for vae, message in refusals.values():
        with pytest.raises(ValueError, match=message) as refused:
            decode_rows(vae, z, VaeSplit(by="frames"))
        assert "\n" not in str(refused.value) and "by='rows', --parallel-vae" in str(refused.value)
    with pytest.raises(ValueError, match="by='time': a VAE decode splits by 'rows' or 'frames'"):
        VaeSplit(by="time")


def test_cli_parallel_vae(pixart, tmp_path, capsys):
    from tessera import cli

    out = tmp_path / "image.png"
    base = ["generate", "--model", str(pixart), "--prompt", "a cat", "--steps", "1", "--out", str(out)]
    size = ["--height", "32", "--width", "16"]
    assert (
        cli.main(base + size + ["--nproc", "2", "--ring", "2", "--parallel-vae", "--vae-chunk-rows", "5"])
        == 0
    )
    assert "wrote a 16x32 image (ring=2, 2 process(es))" in capsys.readouterr().out
    # what the ranks would refuse is refused before any starts, on the weightless pipeline
    from tessera.diffusion.pipelines import check_vae_split, meta_pipeline

    with pytest.raises(ValueError, match="a latent of 2 rows cannot be split over 3 ranks; use at most 2"):
        check_vae_split(meta_pipeline(pixart), torch.zeros(1, 4, 2, 8), 3)


def wan_vae():
    from tiny_wan import tiny_wan_vae

    torch.manual_seed(0)
    vae = tiny_wan_vae()
    with torch.no_grad():  # attention in the mid-block too, and weights off their init
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return vae


WAN_LATENT = (1, 4, 3, 7, 5)  # 3 latent frames (5 video frames) of 7 rows: bands of 4 and 3
WAN_WIDE = (1, 4, 3, 16, 16)  # the memory case: 5 frames of 64 x 64


def ltx_vae():
    from tiny_ltx import tiny_ltx_vae

    torch.manual_seed(0)
    vae = tiny_ltx_vae()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return vae


LTX_LATENT = (1, 8, 3, 7, 5)  # 3 latent frames of 7 rows: bands of 4 and 3


def _four_ranks():
    from tessera.runtime.mesh import Mesh

    mesh = Mesh(vae=4)  # 7 latent rows: bands of 2, 2, 2 and 1 (a one-row band still gives its halo)
    return {
        "kl": decode_rows(tiny_vae(), latent(SMALL), VaeSplit(mesh=mesh, chunk_rows=3)),
        "wan": decode_rows(wan_vae(), latent(WAN_LATENT), VaeSplit(mesh=mesh)),
        "ltx": decode_rows(ltx_vae(), latent(LTX_LATENT), VaeSplit(mesh=mesh)),
    }


def test_four_ranks_with_a_one_row_band():
    with torch.no_grad():
        serial = {
            "kl": tiny_vae().decode(latent(SMALL)).sample,
            "wan": wan_vae().decode(latent(WAN_LATENT)).sample,
            "ltx": ltx_vae().decode(latent(LTX_LATENT), None).sample,
        }
    ranks = spawn(_four_ranks, 4, timeout_s=300)
    assert all(v is None for r in ranks[1:] for v in r.values())
    for name, expected in serial.items():
        assert relative_error(ranks[0][name], expected) < TOLERANCE, name
