"""What ``tessera.train.sharded_checkpoint`` reads and writes of a pipelined rank
(``tessera.train.pipelined``): its stages' parameters and their optimizer states, as the
pieces a ZeRO engine has."""

from __future__ import annotations

import contextlib

import torch


class StageEngine:
    """What ``tessera.train.sharded_checkpoint`` reads and writes of a pipelined rank: the
    parameters of its stages (whole, or their tp shards) and their optimizer states, the
    same pieces a ZeRO-0 engine has, so a checkpoint loads under any other plan."""

    def __init__(self, params, optimizer: torch.optim.Optimizer, *, zero: int = 0):
        self.owner = {p: None for p in params}
        self.optimizer, self.zero = optimizer, zero

    def resident(self):
        return contextlib.nullcontext()

    def pieces(self, names: dict, mesh) -> list:
        """(name, kind, flat local tensor, start, stop, local shape) this rank writes: the
        parameters on dp rank 0 of each stage, the optimizer states where they are (dp rank 0,
        or at ZeRO-1 the rank that steps them); a tp-replicated tensor on tp rank 0 only."""
        out = []
        first = mesh.rank("dp") == 0
        if "sp" in mesh.axes and mesh.rank("sp") != 0:  # sp ranks hold the same stage
            return out
        for p in self.owner:
            local = local_tensor(p)
            if not hasattr(p, "placements") or not any(pl.is_shard() for pl in p.placements):
                if "tp" in mesh.axes and mesh.rank("tp") != 0:
                    continue
            states = self.optimizer.state.get(p, {}) if (first or self.zero) else {}
            tensors = ({"param": local} if first else {}) | states
            for kind, v in tensors.items():
                v = local_tensor(v)
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == local.numel():
                    out.append((names[p], kind, v.detach().reshape(-1), 0, local.numel(), list(local.shape)))
        return out

    def load_local(self, p, kind: str, local: torch.Tensor, scalars: dict) -> None:
        if p not in self.owner:  # another stage's parameter
            return
        with torch.no_grad():
            if kind == "param":
                local_tensor(p.data).copy_(local)
                return
            if not any(p is q for g in self.optimizer.param_groups for q in g["params"]):
                return  # ZeRO-1: another dp rank steps it
            value = local.clone()
            if hasattr(p, "placements"):
                from torch.distributed.tensor import DTensor

                value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False)
            state = self.optimizer.state[p]
            state[kind] = value
            state.update(
                {k: v.clone() if torch.is_tensor(v) else torch.tensor(v) for k, v in scalars.items()}
            )


def local_tensor(t):
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
