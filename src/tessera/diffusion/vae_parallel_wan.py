"""Parallel decode of Wan's causal 3-D VAE (``AutoencoderKLWan``), rows split over ranks.

The VAE's own ``decode`` runs unchanged on each rank's band of latent rows — its frame-by-
frame loop, its causal caches (which then hold the band's rows of past frames) and its
clamp — while the few modules that look across rows are swapped, for the call, for
versions that see the whole frame:

* each ``WanCausalConv3d`` with spatial padding and each 3 x 3 ``Conv2d`` of an upsampler
  takes its halo rows from the neighbouring bands (``exchange_halo``, counted sends) in
  place of its zero padding, which stays at the frame's top and bottom edges;
* the mid-block ``WanAttentionBlock`` (one head, over the tokens of each frame) all-gathers
  the keys and values of every band;
* ``WanRMS_norm`` normalises each position over its channels, and nearest-exact 2x
  upsampling maps row r to row r // 2: both are row-local and run as they are.

Wan 2.2's residual VAE (``is_residual``: AvgDown3D / DupUp3D) and patchified VAEs are
refused by name, and so is tiling.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn

from tessera.diffusion.vae_parallel import (
    VaeSplit,
    _refuse,
    exchange_halo,
    gather_bands,
    row_bounds,
    send_bands_to_first,
)


def check_wan_vae(vae: nn.Module) -> None:
    c = vae.config
    if c.is_residual or c.patch_size is not None:
        _refuse(
            "AutoencoderKLWan with is_residual or patch_size (the Wan 2.2 VAE) is not supported; Wan 2.1's is"
        )
    if vae.use_tiling:
        _refuse("the VAE has tiling enabled (vae.enable_tiling()); disable it, the row split replaces it")


def _with_halo(split: VaeSplit, x: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    """``x`` with ``rows`` rows above and below along ``dim``: the neighbours', or zeros at
    the frame's edges (the convolution's own padding there)."""
    top, bottom = exchange_halo(split, x, rows, dim=dim)
    shape = list(x.shape)
    shape[dim] = rows
    top = x.new_zeros(shape) if top is None else top
    bottom = x.new_zeros(shape) if bottom is None else bottom
    return torch.cat([top, x, bottom], dim=dim)


def _causal_conv(split: VaeSplit):
    def forward(self, x, cache_x=None):
        padding = list(self._padding)  # (w, w, h, h, t_front, 0), as WanCausalConv3d.forward
        if cache_x is not None and padding[4] > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            padding[4] -= cache_x.shape[2]
        if padding[2]:
            x = _with_halo(split, x, padding[2], dim=3)
            padding[2] = padding[3] = 0
        return nn.Conv3d.forward(self, F.pad(x, padding))

    return forward


def _conv2d(split: VaeSplit):
    def forward(self, x):
        p = self.padding[0]
        x = _with_halo(split, x, p, dim=2)
        return F.conv2d(x, self.weight, self.bias, padding=(0, self.padding[1]), groups=self.groups)

    return forward


def _attention(split: VaeSplit, latent_bounds: list[tuple[int, int]]):
    def forward(self, x):
        identity = x
        b, c, t, h, w = x.shape
        x = self.norm(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        q, k, v = self.to_qkv(x).chunk(3, dim=1)  # (b*t, c, h, w) each: rows local
        # every band's keys and values (rows at this block's resolution = the latent's)
        k, v = (gather_bands(split, u, 2, latent_bounds) for u in (k, v))
        q, k, v = (u.flatten(2).transpose(1, 2).unsqueeze(1) for u in (q, k, v))  # (b*t, 1, n, c)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w)
        x = self.proj(x).view(b, t, c, h, w).permute(0, 2, 1, 3, 4)
        return x + identity

    return forward


@contextlib.contextmanager
def _patched(vae: nn.Module, split: VaeSplit, latent_bounds):
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        WanAttentionBlock,
        WanCausalConv3d,
        WanResample,
    )

    swaps = []
    for module in vae.decoder.modules():
        if isinstance(module, WanCausalConv3d):
            k, stride = module.kernel_size, module.stride
            if stride != (1, 1, 1) or k[1] != 2 * module._padding[2] + 1:
                _refuse(f"causal convolution {module} is not stride-1 'same' in space")
            swaps.append((module, _causal_conv(split)))
        elif isinstance(module, WanResample):
            if module.mode not in ("upsample2d", "upsample3d", "none"):
                _refuse(f"decoder resample mode {module.mode!r} is not supported")
            if module.mode != "none":
                conv = module.resample[1]
                if conv.stride != (1, 1) or conv.padding != (1, 1) or conv.kernel_size != (3, 3):
                    _refuse(f"upsampler convolution {conv} is not a 3 x 3 'same' convolution")
                swaps.append((conv, _conv2d(split)))
        elif isinstance(module, WanAttentionBlock):
            swaps.append((module, _attention(split, latent_bounds)))
    try:
        for module, forward in swaps:
            module.forward = types.MethodType(forward, module)
        yield
    finally:
        for module, _ in swaps:
            del module.forward  # the class's own forward again


@torch.no_grad()
def decode_rows_wan(vae: nn.Module, z: torch.Tensor, split: VaeSplit) -> torch.Tensor | None:
    """``vae.decode(z).sample`` for ``AutoencoderKLWan`` with the latent's rows split over
    ``split.axis``: the video (B, 3, T, H, W) on the axis's rank 0, None elsewhere."""
    check_wan_vae(vae)
    if split.chunk_rows is not None:
        _refuse("chunked convolution (--vae-chunk-rows) is not implemented for AutoencoderKLWan yet")
    bounds = row_bounds(split, z.shape[3])
    start, stop = bounds[split.rank]
    if split.size == 1:
        return vae.decode(z, return_dict=False)[0]
    with _patched(vae, split, bounds):
        video = vae.decode(z[:, :, :, start:stop], return_dict=False)[0]
    factor = video.shape[3] // (stop - start)
    return send_bands_to_first(split, video, 3, [(s * factor, e * factor) for s, e in bounds])
