"""Parallel decode of LTX-Video's 3-D VAE (``AutoencoderKLLTXVideo``, LTX-Video 0.9), rows
split over ranks.

As for Wan (``vae_parallel_wan.py``) the VAE's own ``decode`` runs on each rank's band of
latent rows with the row-crossing modules swapped for the call: the ``Conv3d`` inside every
``LTXVideoCausalConv3d`` with spatial padding takes its halo rows from the neighbouring
bands (counted sends) in place of its zero padding, which stays at the frame's edges; the
time padding (replicated first/last frames) is the wrapper's and untouched. Everything
else is row-local: RMS and layer norms over channels, the upsamplers' and the final
depth-to-space rearrangements (row r becomes rows r*s ... r*s+s-1), and there is no
attention in this decoder. Refused by name: a timestep-conditioned decoder, noise
injection, framewise or tiled decoding.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn

from tessera.diffusion.vae_parallel import VaeSplit, _refuse, row_bounds, send_bands_to_first
from tessera.diffusion.vae_parallel_wan import _with_halo


def check_ltx_vae(vae: nn.Module) -> None:
    c = vae.config
    if c.timestep_conditioning or any(c.decoder_inject_noise):
        _refuse(
            "AutoencoderKLLTXVideo with timestep conditioning or noise injection (LTX-Video 0.9.1+) is not "
            "supported; LTX-Video 0.9's is"
        )
    if vae.use_tiling or vae.use_framewise_decoding:
        _refuse("the VAE has tiled or framewise decoding enabled; disable it, the row split replaces it")


def _conv3d(split: VaeSplit):
    def forward(self, x):
        p = self.padding[1]
        x = _with_halo(split, x, p, dim=3)
        return F.conv3d(
            x, self.weight, self.bias, padding=(self.padding[0], 0, self.padding[2]), groups=self.groups
        )

    return forward


@contextlib.contextmanager
def _patched(vae: nn.Module, split: VaeSplit):
    from diffusers.models.autoencoders.autoencoder_kl_ltx import LTXVideoCausalConv3d

    swaps = []
    for module in vae.decoder.modules():
        if isinstance(module, LTXVideoCausalConv3d):
            conv = module.conv
            k = conv.kernel_size
            if conv.stride != (1, 1, 1) or conv.padding_mode != "zeros" or conv.padding[1] != k[1] // 2:
                _refuse(f"causal convolution {conv} is not stride-1 'same' in space with zero padding")
            if conv.padding[1]:
                swaps.append((conv, _conv3d(split)))
    try:
        for module, forward in swaps:
            module.forward = types.MethodType(forward, module)
        yield
    finally:
        for module, _ in swaps:
            del module.forward


@torch.no_grad()
def decode_rows_ltx(vae: nn.Module, z: torch.Tensor, split: VaeSplit) -> torch.Tensor | None:
    """``vae.decode(z).sample`` for ``AutoencoderKLLTXVideo`` with the latent's rows split
    over ``split.axis``: the video on the axis's rank 0, None elsewhere."""
    check_ltx_vae(vae)
    if split.chunk_rows is not None:
        _refuse("chunked convolution (--vae-chunk-rows) is not implemented for AutoencoderKLLTXVideo yet")
    bounds = row_bounds(split, z.shape[3])
    if split.size == 1:
        return vae.decode(z, None, return_dict=False)[0]
    start, stop = bounds[split.rank]
    with _patched(vae, split):
        video = vae.decode(z[:, :, :, start:stop], None, return_dict=False)[0]
    factor = video.shape[3] // (stop - start)
    return send_bands_to_first(split, video, 3, [(s * factor, e * factor) for s, e in bounds])
