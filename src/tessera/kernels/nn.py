"""Drop-in modules whose forward and backward run on Tessera's kernels: the same parameters,
initialisation and state_dict as torch's ``nn.Linear`` / ``nn.Conv2d``. The bias is added by
torch (a broadcast add, not an operator of the compiler).

In inference (no gradient wanted, not being traced) a module keeps its weight packed as its
kernel reads it (MKL's packed GEMM, oneDNN's reordered weights): packed on the first call and
again whenever the weight changes (its storage or its version), one packing per input shape for
the last few shapes, bit for bit the same results."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from tessera.kernels import torch_ops


def _inference(x: Tensor, weight: Tensor) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def _packed(module: nn.Module) -> OrderedDict:
    """The module's packed weights (``torch_ops.PACKED_SHAPES`` input shapes at most)."""
    return module.__dict__.setdefault("_tessera_packed", OrderedDict())


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if _inference(x, self.weight):
            y = torch_ops.matmul_weight_packed(flat, self.weight, _packed(self))
        else:
            y = torch_ops.matmul(flat, self.weight, False, True)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)


class Conv2d(nn.Conv2d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.padding_mode != "zeros" or any(d != 1 for d in self.dilation) or isinstance(self.padding, str):
            raise ValueError(
                f"tessera.kernels.Conv2d supports zero padding given as ints and dilation 1; got "
                f"padding={self.padding!r}, padding_mode={self.padding_mode!r}, dilation={self.dilation}"
            )

    def forward(self, x: Tensor) -> Tensor:
        args = (x, self.weight, list(self.stride), list(self.padding), self.groups)
        if _inference(x, self.weight):
            y = torch_ops.conv2d_weight_packed(*args, _packed(self))
        else:
            y = torch_ops.conv2d(*args)
        if self.bias is not None:
            y = y + self.bias.view(1, -1, 1, 1)
        return y


def convert(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear and nn.Conv2d inside ``module`` (in place) by Tessera's, same weights."""
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            new = Linear(child.in_features, child.out_features, bias=child.bias is not None)
        elif type(child) is nn.Conv2d:
            new = Conv2d(child.in_channels, child.out_channels, child.kernel_size, stride=child.stride,
                         padding=child.padding, dilation=child.dilation, groups=child.groups,
                         bias=child.bias is not None, padding_mode=child.padding_mode)
        else:
            convert(child)
            continue
        new.load_state_dict(child.state_dict())
        setattr(module, name, new)
    return module
