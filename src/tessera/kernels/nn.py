"""Drop-in modules whose forward and backward run on Tessera's kernels: the same parameters,
initialisation and state_dict as torch's ``nn.Linear`` / ``nn.Conv2d``. The bias is added by
torch (a broadcast add, not an operator of the compiler).

In inference (no gradient wanted, not being traced) a module keeps its weight packed as its
kernel reads it (MKL's packed GEMM, oneDNN's reordered weights): packed on the first call and
again whenever the weight changes (its storage or its version), bit for bit the same results."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tessera.kernels import ops, torch_ops


def _inference(x: Tensor, weight: Tensor) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if _inference(x, self.weight) and flat.dtype == self.weight.dtype == torch.float32 and flat.device.type == "cpu":
            op = ops.gemm(flat.shape[0], self.out_features, self.in_features, trans_b=True)
            cache = self.__dict__.setdefault("_tessera_packed", {})
            y = torch_ops.run_weight_packed(op, {"A": flat, "B": self.weight}, "B", cache)
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
        if _inference(x, self.weight) and x.dim() == 4 and x.dtype == self.weight.dtype == torch.float32 \
                and x.device.type == "cpu":
            s = torch_ops.conv_shape(x.shape, self.weight.shape, self.stride, self.padding, self.groups)
            cache = self.__dict__.setdefault("_tessera_packed", {})
            y = torch_ops.run_weight_packed(ops.conv2d(s), {"X": x, "W": self.weight}, "W", cache).view(s.output_shape)
        else:
            y = torch_ops.conv2d(x, self.weight, list(self.stride), list(self.padding), self.groups)
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
