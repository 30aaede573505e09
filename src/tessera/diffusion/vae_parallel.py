"""Parallel VAE decode (DistVAE, as in xDiT) and chunked convolution for one device.

The latent is split by rows across the ranks of one mesh axis; every rank decodes its band
through the VAE decoder's own modules (their weights, walked in the decoder's order), and
the few operations that look across rows are made to see the whole image:

* each 3 x 3 convolution receives the halo rows it needs (``padding`` rows above and below)
  from its neighbours by point-to-point sends (counted by ``tessera.runtime.comm``); rows
  past the image's top and bottom are the convolution's zero padding, as serially;
* group normalisation uses statistics reduced over all ranks (sums of x and x^2 per group in
  float64, one all-reduce per norm): a per-rank norm would be a different model;
* the mid-block attention all-gathers the keys and values of every band (bands padded to
  equal rows for the collective, then trimmed); each rank answers its own queries;
* nearest 2x upsampling is row-local: band ``[a, b)`` becomes ``[2a, 2b)``.

Chunked convolution (``chunk_rows``): each normalise-activate-(upsample)-convolve step runs
over row chunks of its output (with their halo), so the normalised, activated and upsampled
copies of a feature map exist one chunk at a time; with ``chunk_rows`` alone on one device
this cuts the decode's activation peak, on N ranks it composes with the split.

Only VAE classes whose decoder is walked here are accepted (``KNOWN_VAES``); any other is
refused by name, and so is any module of a known class configured in a way the walk does not
reproduce (spatial norm, transposed-conv upsampling, tiling, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.diffusion.layout import split_rows
from tessera.runtime.mesh import Mesh

KNOWN_VAES = ("AutoencoderKL", "AutoencoderKLWan", "AutoencoderKLLTXVideo")  # video: vae_parallel_wan/_ltx.py


def _refuse(what: str) -> None:
    raise ValueError(f"parallel VAE decode: {what}")


def check_vae(vae: nn.Module) -> None:
    """Refuse, by name, a VAE or decoder configuration the walk below does not reproduce."""
    name = type(vae).__name__
    if name not in KNOWN_VAES:
        _refuse(f"VAE class {name} is not supported; supported: {', '.join(KNOWN_VAES)} (or decode serially)")
    if getattr(vae, "use_tiling", False):
        _refuse("the VAE has tiling enabled (vae.enable_tiling()); disable it, the row split replaces it")
    if name == "AutoencoderKLWan":
        from tessera.diffusion.vae_parallel_wan import check_wan_vae

        return check_wan_vae(vae)
    if name == "AutoencoderKLLTXVideo":
        from tessera.diffusion.vae_parallel_ltx import check_ltx_vae

        return check_ltx_vae(vae)
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D, UpDecoderBlock2D
    from diffusers.models.upsampling import Upsample2D

    dec = vae.decoder
    if not isinstance(dec.conv_norm_out, nn.GroupNorm):
        _refuse(
            f"decoder norm {type(dec.conv_norm_out).__name__} (spatial norm) is not supported; GroupNorm is"
        )
    if type(dec.mid_block) is not UNetMidBlock2D:
        _refuse(f"mid block {type(dec.mid_block).__name__} is not supported; UNetMidBlock2D is")
    for block in dec.up_blocks:
        if type(block) is not UpDecoderBlock2D:
            _refuse(f"up block {type(block).__name__} is not supported; UpDecoderBlock2D is")
        for up in block.upsamplers or ():
            if (
                type(up) is not Upsample2D
                or up.use_conv_transpose
                or up.norm is not None
                or not up.interpolate
            ):
                _refuse("an upsampler other than nearest interpolation + convolution is not supported")
    for m in dec.modules():
        if isinstance(m, ResnetBlock2D):
            if m.upsample is not None or m.downsample is not None or m.time_emb_proj is not None:
                _refuse("a resnet block that resamples or takes a time embedding is not supported")
            if not isinstance(m.norm1, nn.GroupNorm) or not isinstance(m.norm2, nn.GroupNorm):
                _refuse(f"resnet norm {type(m.norm1).__name__} is not supported; GroupNorm is")
        elif isinstance(m, Attention):
            if (
                m.spatial_norm is not None
                or m.norm_q is not None
                or m.norm_k is not None
                or m.is_cross_attention
            ):
                _refuse("mid-block attention with spatial/q/k norms or cross attention is not supported")
        elif isinstance(m, nn.Conv2d):
            k, p = m.kernel_size, m.padding
            if (
                m.stride != (1, 1)
                or m.dilation != (1, 1)
                or m.padding_mode != "zeros"
                or isinstance(p, str)
                or k[0] % 2 == 0
                or p[0] != k[0] // 2
            ):
                _refuse(f"convolution {m} is not a stride-1 'same' convolution with zero padding")


SPLITS = ("rows", "frames")


def refuse_frame_split(vae: nn.Module) -> None:
    """Why no VAE here splits a decode by frames, in one line, and what does work."""
    name = type(vae).__name__
    if name == "AutoencoderKLWan":
        _refuse(
            "a frame split of AutoencoderKLWan is refused: its causal decode runs frame by frame and each "
            "frame reads the convolution caches the previous frame wrote, so rank r+1 could start only when "
            "rank r had finished (no speedup, and every rank would hold the same caches and per-frame "
            "activations); split by rows (by='rows', --parallel-vae), which divides both"
        )
    if name == "AutoencoderKLLTXVideo":
        _refuse(
            "a frame split of AutoencoderKLLTXVideo is not implemented; split by rows (by='rows', "
            "--parallel-vae)"
        )
    _refuse(
        f"{name} decodes images, which have no frames to split; split by rows (by='rows', --parallel-vae)"
    )


@dataclass(frozen=True, kw_only=True)
class VaeSplit:
    """How a decode is spread: ``axis`` of ``mesh`` (None: one device) and, optionally, the
    output rows each chunked convolution step computes at once."""

    mesh: Mesh | None = None
    axis: str = "vae"
    chunk_rows: int | None = None
    reduce_norm: bool = True  # False only to show a per-rank norm is a different model
    by: str = "rows"  # "frames": refused for every VAE, each with its reason (refuse_frame_split)

    def __post_init__(self) -> None:
        if self.by not in SPLITS:
            raise ValueError(f"by={self.by!r}: a VAE decode splits by {' or '.join(map(repr, SPLITS))}")
        if self.chunk_rows is not None and (not isinstance(self.chunk_rows, int) or self.chunk_rows < 1):
            raise ValueError(f"chunk_rows must be an integer >= 1 or None, got {self.chunk_rows!r}")

    @property
    def size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size(self.axis)

    @property
    def rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.rank(self.axis)


def exchange_halo(split: VaeSplit, x: torch.Tensor, rows: int, *, dim: int):
    """(the ``rows`` rows above this band, the ``rows`` rows below it) along ``dim``, sent by
    the neighbouring ranks (counted point-to-point); None past the image's top or bottom."""
    if rows == 0 or split.size == 1:
        return None, None
    if x.shape[dim] < rows:
        _refuse(f"a band of {x.shape[dim]} rows cannot give a halo of {rows}; use fewer ranks")
    comm, axis, rank = split.mesh.comm, split.axis, split.rank
    shape = list(x.shape)
    shape[dim] = rows
    works, keep, top, bottom = [], [], None, None
    if rank > 0:
        top = x.new_empty(shape)
        send = x.narrow(dim, 0, rows).contiguous()
        keep.append(send)
        works += [comm.isend(send, axis, dst=rank - 1), comm.irecv(top, axis, src=rank - 1)]
    if rank < split.size - 1:
        bottom = x.new_empty(shape)
        send = x.narrow(dim, x.shape[dim] - rows, rows).contiguous()
        keep.append(send)
        works += [comm.isend(send, axis, dst=rank + 1), comm.irecv(bottom, axis, src=rank + 1)]
    for work in works:
        work.wait()
    return top, bottom


def gather_bands(split: VaeSplit, t: torch.Tensor, dim: int, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """Every rank's band of ``t`` along ``dim``, concatenated (all-gathered; bands padded to
    the widest for the collective, then trimmed). ``bounds``: the bands' [start, stop)."""
    widest = max(e - s for s, e in bounds)
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, widest - t.shape[dim]]
    every = split.mesh.comm.all_gather(F.pad(t, pad).contiguous(), split.axis, dim=dim)
    return torch.cat([every.narrow(dim, i * widest, e - s) for i, (s, e) in enumerate(bounds)], dim=dim)


def send_bands_to_first(split: VaeSplit, t: torch.Tensor, dim: int, bounds) -> torch.Tensor | None:
    """The whole of ``t`` along ``dim`` on the axis's rank 0 (bands sent point to point,
    counted), None elsewhere. ``bounds``: the bands' [start, stop) at ``t``'s resolution."""
    if split.size == 1:
        return t
    comm, axis = split.mesh.comm, split.axis
    if split.rank != 0:
        comm.isend(t.contiguous(), axis, dst=0).wait()
        return None
    parts = [t]
    for r, (s, e) in enumerate(bounds[1:], start=1):
        shape = list(t.shape)
        shape[dim] = e - s
        part = t.new_empty(shape)
        comm.irecv(part, axis, src=r).wait()
        parts.append(part)
    return torch.cat(parts, dim=dim)


class _Band:
    """This rank's band of a row-split map: the rows it holds and the halos it was sent."""

    def __init__(self, split: VaeSplit, x: torch.Tensor, bounds: list[tuple[int, int]]):
        self.split, self.x, self.bounds = split, x, bounds
        self.top = self.bottom = None

    @property
    def first(self) -> bool:
        return self.split.rank == 0

    @property
    def last(self) -> bool:
        return self.split.rank == self.split.size - 1

    def exchange(self, rows: int) -> None:
        """Receive ``rows`` rows from each neighbour (none past the image's edges)."""
        self.top, self.bottom = exchange_halo(self.split, self.x, rows, dim=2)

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, int, int]:
        """Rows [lo, hi) in band coordinates (negative: the halo above), clipped to what
        exists, and how many rows past the image's top and bottom were clipped."""
        h = self.x.shape[2]
        top_n = 0 if self.top is None else self.top.shape[2]
        bot_n = 0 if self.bottom is None else self.bottom.shape[2]
        missing_top, missing_bottom = max(0, -top_n - lo), max(0, hi - (h + bot_n))
        lo, hi = max(lo, -top_n), min(hi, h + bot_n)
        assert (missing_top == 0 or self.first) and (missing_bottom == 0 or self.last), "halo too small"
        parts = []
        if lo < 0:
            parts.append(self.top[:, :, top_n + lo : top_n + min(hi, 0)])
        if hi > 0 and lo < h:
            parts.append(self.x[:, :, max(lo, 0) : min(hi, h)])
        if hi > h:
            parts.append(self.bottom[:, :, max(lo - h, 0) : hi - h])
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)), missing_top, missing_bottom


class _Walk:
    """The decoder's modules applied to one rank's band."""

    def __init__(self, split: VaeSplit, bounds: list[tuple[int, int]]):
        self.split, self.bounds = split, bounds  # bounds of the current resolution

    # -- pieces -------------------------------------------------------------------------
    def _chunks(self, rows: int, step: int | None = None):
        step = step or self.split.chunk_rows or rows
        return [(s, min(s + step, rows)) for s in range(0, rows, step)]

    def norm_stats(self, x: torch.Tensor, norm: nn.GroupNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, rstd) per (batch, group) over the whole image: float64 sums of x and x^2
        gathered chunk by chunk (an eighth of the band at most: the float64 copy stays small),
        then summed over ranks in one all-reduce."""
        b, g = x.shape[0], norm.num_groups
        sums = torch.zeros(3, b, g, dtype=torch.float64, device=x.device)
        step = min(self.split.chunk_rows or x.shape[2], -(-x.shape[2] // 8))
        for s, e in self._chunks(x.shape[2], step):
            part = x[:, :, s:e].reshape(b, g, -1).double()
            sums[0] += part.sum(-1)
            sums[1] += part.square().sum(-1)
            sums[2] += part.shape[-1]
        if self.split.size > 1 and self.split.reduce_norm:
            self.split.mesh.comm.all_reduce(sums, self.split.axis)
        mean = sums[0] / sums[2]
        var = (sums[1] / sums[2] - mean.square()).clamp_min(0)
        return mean, torch.rsqrt(var + norm.eps)

    @staticmethod
    def normalise(t: torch.Tensor, norm: nn.GroupNorm, stats) -> torch.Tensor:
        """A new tensor: ``t`` normalised with ``stats`` (operations after the first in place,
        so one copy of ``t`` exists at a time)."""
        mean, rstd = stats
        b, c = t.shape[:2]
        g = norm.num_groups
        shape = (b, g, c // g, *t.shape[2:])
        view = (b, g) + (1,) * (len(shape) - 2)
        out = t.reshape(shape) - mean.view(view).to(t.dtype)
        out.mul_(rstd.view(view).to(t.dtype))
        out = out.view(t.shape)
        if norm.affine:
            affine = (1, c) + (1,) * (t.dim() - 2)
            out.mul_(norm.weight.view(affine)).add_(norm.bias.view(affine))
        return out

    def conv(
        self,
        x: torch.Tensor,
        conv: nn.Conv2d,
        *,
        norm: nn.GroupNorm | None = None,
        act: nn.Module | None = None,
        upsample: int = 1,
    ) -> torch.Tensor:
        """conv(upsample(act(norm(x)))) on this band, chunk by chunk of output rows.

        Each chunk's input carries the halo rows that exist (a neighbour's, or this band's
        own next chunk's); where it meets the image's top or bottom edge the convolution's
        own zero padding is the image's, and the rows its padding adds inside the image
        are dropped."""
        p = conv.padding[0]
        band = _Band(self.split, x, self.bounds)
        band.exchange(math.ceil(p / upsample))
        stats = self.norm_stats(x, norm) if norm is not None else None
        rows = x.shape[2] * upsample
        chunks = self._chunks(rows)
        out = None
        for s, e in chunks:
            src_lo, src_hi = (s - p) // upsample, -(-(e + p) // upsample)
            src, cut_top, _ = band.rows(src_lo, src_hi)
            if norm is not None:
                src = self.normalise(src, norm, stats)
            if act is not None:
                src = F.silu(src, inplace=True) if type(act) is nn.SiLU and norm is not None else act(src)
            if upsample > 1:
                src = F.interpolate(src, scale_factor=float(upsample), mode="nearest")
            first = (src_lo + cut_top) * upsample  # the upsampled row src's first row is
            lo = max(s - p, first)
            src = src[:, :, lo - first : min(e + p, first + src.shape[2]) - first]
            y = F.conv2d(src, conv.weight, conv.bias, padding=conv.padding, groups=conv.groups)
            y = y[:, :, s - lo : e - lo]
            if len(chunks) == 1:
                return y
            if out is None:
                out = y.new_empty((*y.shape[:2], rows, y.shape[3]))
            out[:, :, s:e] = y
        return out

    def resnet(self, x: torch.Tensor, block) -> torch.Tensor:
        h = self.conv(x, block.conv1, norm=block.norm1, act=block.nonlinearity)
        h = self.conv(h, block.conv2, norm=block.norm2, act=block.nonlinearity)  # dropout: eval
        shortcut = x if block.conv_shortcut is None else block.conv_shortcut(x)
        h.add_(shortcut)
        return h.div_(block.output_scale_factor) if block.output_scale_factor != 1 else h

    def attention(self, x: torch.Tensor, attn) -> torch.Tensor:
        """Self-attention of every band's tokens: keys and values all-gathered (bands padded to
        the widest for the collective), queries local."""
        b, c, h, w = x.shape
        tokens = x
        if attn.group_norm is not None:
            tokens = self.normalise(x, attn.group_norm, self.norm_stats(x, attn.group_norm))
        tokens = tokens.reshape(b, c, h * w).transpose(1, 2)
        q, k, v = attn.to_q(tokens), attn.to_k(tokens), attn.to_v(tokens)
        if self.split.size > 1:
            k, v = (self._gather_tokens(t, w) for t in (k, v))
        heads = attn.heads
        d = q.shape[-1] // heads
        q, k, v = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(b, -1, heads * d).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        out = out.transpose(-1, -2).reshape(b, c, h, w)
        if attn.residual_connection:
            out = out + x
        return out / attn.rescale_output_factor

    def _gather_tokens(self, t: torch.Tensor, width: int) -> torch.Tensor:
        return gather_bands(self.split, t, 1, [(s * width, e * width) for s, e in self.bounds])

    # -- the decoder --------------------------------------------------------------------
    def decoder(self, z: torch.Tensor, dec) -> torch.Tensor:
        x = self.conv(z, dec.conv_in)
        mid = dec.mid_block
        x = self.resnet(x, mid.resnets[0])
        for attn, resnet in zip(mid.attentions, mid.resnets[1:], strict=True):
            if attn is not None:
                x = self.attention(x, attn)
            x = self.resnet(x, resnet)
        for block in dec.up_blocks:
            for resnet in block.resnets:
                x = self.resnet(x, resnet)
            for up in block.upsamplers or ():
                x = self.conv(x, up.conv, upsample=2)
                self.bounds = [(2 * s, 2 * e) for s, e in self.bounds]
        return self.conv(x, dec.conv_out, norm=dec.conv_norm_out, act=dec.conv_act)


def row_bounds(split: VaeSplit, rows: int) -> list[tuple[int, int]]:
    """Each rank's band of a latent's ``rows`` (one line's error when there are fewer rows
    than ranks): the split every VAE's row decode uses."""
    if rows < split.size:
        raise ValueError(
            f"parallel VAE decode: a latent of {rows} rows cannot be split over {split.size} ranks; "
            f"use at most {rows}"
        )
    return split_rows(rows, split.size)


@torch.no_grad()
def decode_rows(vae: nn.Module, z: torch.Tensor, split: VaeSplit) -> torch.Tensor | None:
    """``vae.decode(z).sample`` with the latent's rows split over ``split.axis``: the whole
    image on the axis's rank 0, None on its other ranks. Every rank passes the whole ``z``
    (after denoising every rank holds it) and decodes its own band."""
    check_vae(vae)
    if split.by == "frames":
        refuse_frame_split(vae)
    if type(vae).__name__ == "AutoencoderKLWan":
        from tessera.diffusion.vae_parallel_wan import decode_rows_wan

        return decode_rows_wan(vae, z, split)
    if type(vae).__name__ == "AutoencoderKLLTXVideo":
        from tessera.diffusion.vae_parallel_ltx import decode_rows_ltx

        return decode_rows_ltx(vae, z, split)
    bounds = row_bounds(split, z.shape[2])
    start, stop = bounds[split.rank]
    band = z[:, :, start:stop]
    if vae.post_quant_conv is not None:
        band = vae.post_quant_conv(band)  # 1 x 1: row-local
    image = _Walk(split, bounds).decoder(band, vae.decoder)
    factor = image.shape[2] // (stop - start)
    return send_bands_to_first(split, image, 2, [(s * factor, e * factor) for s, e in bounds])


def halo_bytes(
    vae: nn.Module, latent_shape: tuple[int, ...], *, rank: int, ranks: int, element_size: int = 4
) -> int:
    """Bytes one rank sends in halo exchanges over a decode (equal to the bytes it receives):
    per convolution with ``padding`` p, ``ceil(p / upsample)`` rows of its input (channels x
    width at the input's resolution) to each neighbour. The final gather is not included."""
    dec = vae.decoder
    batch, _, _, width = latent_shape
    neighbours = (rank > 0) + (rank < ranks - 1)
    convs = [(dec.conv_in, width, 1)]
    convs += [(r.conv1, width, 1) for r in dec.mid_block.resnets] + [
        (r.conv2, width, 1) for r in dec.mid_block.resnets
    ]
    for block in dec.up_blocks:
        convs += [(c, width, 1) for r in block.resnets for c in (r.conv1, r.conv2)]
        for up in block.upsamplers or ():
            convs.append((up.conv, width, 2))
            width *= 2
    convs.append((dec.conv_out, width, 1))
    per_neighbour = sum(c.in_channels * w * math.ceil(c.padding[0] / u) for c, w, u in convs)
    return neighbours * batch * per_neighbour * element_size
