"""swCaffe's point on our side: a ResNet-8 trains on the digits with every conv and linear,
forward and backward, on Tessera's kernels, and its losses equal those of the same model
(same initialisation, same batches) on torch's ops."""

import torch

from tessera.bench.kernels_training import train_pair
from tessera.kernels import Conv2d, Linear
from tessera.kernels import torch_ops as T

STEPS = 4
# Each conv's float32 result differs from torch's by reassociation only (about sqrt(K) x 6e-8
# relative, K <= 576 here); through batch norm and four SGD steps with momentum the loss moved
# by at most 3e-6 when measured. 1e-4 leaves a 30-fold margin and is still 100x smaller than
# the loss change of a single step, so a wrong gradient anywhere cannot pass.
LOSS_TOLERANCE = 1e-4


def test_resnet8_trains_like_torch(machine):
    T._KERNELS.clear()
    losses = train_pair(STEPS)  # the kernels benchmark's batch (64): the same kernels, compiled once a session
    used = {k[0].split("[")[0] for k in T._KERNELS}
    # forward convs, their weight and data gradients (GEMM + col2im or direct), the classifier's
    # forward (x W^T), input gradient (dY W) and weight gradient (dY^T X)
    assert {"conv2d", "conv2d_wgrad", "gemm_nt", "gemm_nn", "gemm_tn"} <= used, used
    assert {"conv2d_colgrad", "col2im"} <= used or "conv2d_dgrad" in used, used
    gaps = [abs(a - b) for a, b in zip(losses["torch"], losses["tessera"], strict=True)]
    assert max(gaps) <= LOSS_TOLERANCE, (losses, gaps)
    assert losses["tessera"][-1] < losses["tessera"][0]  # it learns
    assert abs(losses["torch"][1] - losses["torch"][0]) > 100 * LOSS_TOLERANCE


def test_modules_are_drop_in():
    assert issubclass(Conv2d, torch.nn.Conv2d) and issubclass(Linear, torch.nn.Linear)
