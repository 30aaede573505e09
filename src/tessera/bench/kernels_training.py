"""swCaffe's point in `tessera bench kernels`: a ResNet-8 trained on the digits with every
conv and linear forward and backward on Tessera's kernels, beside the same model (same init,
same batches) on torch's ops; the two loss curves."""

from __future__ import annotations

import time


def resnet8(num_classes: int = 10):
    """A ResNet-8 (stem + three basic blocks of widths 16/32/64) for 1-channel 16x16 digits."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
            return (y + (x if self.down is None else self.down(x))).relu()

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes),
    )


def digit_batches(steps: int, batch: int = 64, seed: int = 0):
    """The bundled digits upsampled to 16x16, in a fixed shuffled order of batches."""
    import torch
    import torch.nn.functional as F

    from tessera.data.digits import load_digits_images

    images, labels = load_digits_images()
    images = F.interpolate(images, size=(16, 16), mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < steps:
        order = torch.randperm(len(images), generator=g)
        out += [(images[order[i:i + batch]], labels[order[i:i + batch]])
                for i in range(0, len(images) - batch + 1, batch)]
    return out[:steps]


def train_pair(steps: int, *, batch: int = 64, lr: float = 0.05):
    """Losses of the same ResNet-8 (same init, same batches) trained with torch's ops and with
    every conv and linear forward and backward on Tessera's kernels."""
    import copy

    import torch

    from tessera.kernels.nn import convert

    torch.manual_seed(0)
    ref = resnet8()
    mine = convert(copy.deepcopy(ref))
    losses = {"torch": [], "tessera": []}
    for name, model in (("torch", ref), ("tessera", mine)):
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        for x, y in digit_batches(steps, batch):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    return losses


def train_curves(steps: int) -> dict:
    began = time.perf_counter()
    losses = train_pair(steps)
    gaps = [abs(a - b) for a, b in zip(losses["torch"], losses["tessera"], strict=True)]
    every = max(1, steps // 10)
    table = [{"step": i, "torch": round(losses["torch"][i], 5), "tessera": round(losses["tessera"][i], 5),
              "gap": f"{gaps[i]:.2e}"} for i in list(range(0, steps, every)) + [steps - 1]]
    return {"steps": steps, "losses": losses, "max_abs_gap": max(gaps), "table": table,
            "seconds": round(time.perf_counter() - began, 1)}
