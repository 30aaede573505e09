r"""Train under `tessera launch` (torchrun): join the process group, boost, train.

One node, two processes:

    tessera launch -n 2 examples/launch_train.py --steps 20

Two nodes (here two agents on one machine; on a cluster, run the same line on every node
with the first node's address as the endpoint):

    tessera launch --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id demo examples/launch_train.py --steps 20
"""

import argparse

import torch
import torch.distributed as dist

import tessera
from tessera.runtime import init_from_env


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean loss of one micro-batch (this rank's share of the global batch)."""
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-per-rank", type=int, default=16, help="samples each rank trains on per step")
    parser.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3])
    args = parser.parse_args()

    init_from_env()  # RANK, WORLD_SIZE, MASTER_ADDR/PORT as torchrun sets them
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # boost gives every replica rank 0's weights; seeded, runs repeat
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan = tessera.Plan(dp=world, zero=args.zero)
    model, optimizer = tessera.boost(model, optimizer, plan)

    data = torch.Generator().manual_seed(0)  # the same seed everywhere: the same global batches
    target = torch.randn(16, 1, generator=data)
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch_per_rank * world, 16, generator=data)  # the global batch
        stats = optimizer.train_step((x, x @ target), loss_fn)  # each rank trains on its share
        losses.append(stats["loss"])  # the mean over the ranks
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {stats['loss']:.4f}", flush=True)
    print(f"rank {rank}/{world}: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
