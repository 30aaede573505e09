"""Writing sampled images as one PNG grid."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def check_writable(path: str | Path, suffix: str = ".png") -> Path:
    """Fail before any work is done if ``path`` cannot be written."""
    path = Path(path)
    if path.suffix.lower() != suffix:
        raise ValueError(f"output file {path} must end in {suffix}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"cannot write {path}: folder {parent} does not exist")
    if path.is_dir():
        raise ValueError(f"cannot write {path}: it is a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".tessera-write-check-"):
            pass
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror}") from None
    return path


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, C, H, W) in [-1, 1] -> (B, H, W, C) uint8."""
    pixels = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).cpu().numpy()


def save_grid(
    images: torch.Tensor, path: str | Path, *, columns: int | None = None, scale: int = 1, pad: int = 1
) -> Path:
    """Tile ``images`` (B, C, H, W), values in [-1, 1], row-major into one PNG."""
    pixels = to_uint8(images)
    b, h, w, c = pixels.shape
    columns = columns or math.ceil(math.sqrt(b))
    rows = math.ceil(b / columns)
    canvas = np.zeros((rows * (h + pad) + pad, columns * (w + pad) + pad, c), dtype=np.uint8)
    for i in range(b):
        r, col = divmod(i, columns)
        y, x = pad + r * (h + pad), pad + col * (w + pad)
        canvas[y : y + h, x : x + w] = pixels[i]
    image = Image.fromarray(canvas[..., 0] if c == 1 else canvas)
    if scale > 1:
        image = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    image.save(partial, format="PNG")
    os.replace(partial, path)  # a reader never sees a half-written picture
    return path
