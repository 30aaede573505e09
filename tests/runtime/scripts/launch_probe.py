"""Run by `tessera launch` in the tests: joins torchrun's group, all-reduces, reports."""

import json
import sys

import torch

from tessera.runtime import Mesh, init_from_env

init_from_env(timeout_s=60)
mesh = Mesh(dp=torch.distributed.get_world_size())
x = torch.tensor([float(mesh.global_rank + 1)])
mesh.comm.all_reduce(x, "dp")
with open(f"{sys.argv[1]}.rank{mesh.global_rank}.json", "w") as f:
    json.dump({"sum": x.item(), "extra": sys.argv[2:], "ledger": mesh.comm.ledger.snapshot()}, f)
torch.distributed.barrier()  # no rank leaves while a peer still talks to it
torch.distributed.destroy_process_group()
