"""Data parallel training on torch's DDP, with its gradient all-reduce routed through
Tessera's counted comm so the bytes show up in the mesh's ledger."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tessera.runtime.comm import Comm
from tessera.runtime.mesh import Mesh


def _counted_allreduce_hook(
    state: tuple[Comm, str], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    comm, axis = state
    grads = bucket.buffer()
    grads.div_(comm.mesh.size(axis))  # average = sum of (grad / N); no PREMUL_SUM on gloo
    work = comm.all_reduce(grads, axis, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def data_parallel(model: nn.Module, mesh: Mesh, axis: str = "dp") -> nn.Module:
    """``model`` replicated along ``axis``; gradients averaged over it after backward.

    Along an axis of size 1 the model is returned unchanged (single-process runs).
    """
    if mesh.size(axis) == 1:
        return model
    ddp = DistributedDataParallel(model, process_group=mesh.group(axis))
    ddp.register_comm_hook((mesh.comm, axis), _counted_allreduce_hook)
    return ddp
