"""Offload: train a small model whose ZeRO-3 chunks move between host memory and disk.

    python examples/offload_train.py                          # 3 steps, 120 kB host budget
    python examples/offload_train.py --blocks 8 --width 256 --host-memory 2MiB --steps 10

`Plan(zero=3, offload="auto", host_memory=..., offload_dir=...)` keeps each rank's chunks of
parameters, gradients and Adam moments in tiers with byte budgets (PatrickStar; see
docs/offload.md): what does not fit the host budget waits on disk, and a warm-up trace
decides what to evict and what to prefetch. The script first prints the dry run (what each
tier will hold and what moves per step), then trains with offload and again in memory from
the same weights and batches: fp32 offload is bit-exact, so the losses are equal, not close.
"""

import argparse
import tempfile

import torch
from torch import nn

import tessera
from tessera.train.plan import memory_report, parse_bytes


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = (
            nn.LayerNorm(width),
            nn.Linear(width, 4 * width),
            nn.Linear(4 * width, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    """Repeated residual MLP blocks (an nn.ModuleList: what Plan(block_chunks=True) cuts at)."""

    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(Residual(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def build(args: argparse.Namespace) -> Model:
    torch.manual_seed(0)
    return Model(args.width, args.blocks)


def train(args: argparse.Namespace, plan: tessera.Plan) -> tuple[list[float], dict | None]:
    model = build(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = tessera.boost(model, optimizer, plan)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=data)
        losses.append(optimizer.train_step((x, x.mean(1, keepdim=True)), loss_fn)["loss"])
    offload = optimizer.engine.offload
    return losses, offload.moved() if offload is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="samples per step")
    parser.add_argument("--steps", type=int, default=3)
    # one chunk per block (block_chunks: 34 kB each at width 32); 200 kB of host memory for
    # 0.55 MB of parameters, gradients and two Adam moments: every kind of chunk is evicted to
    # disk and fetched back every step, while a step's working set still fits
    parser.add_argument("--host-memory", default="200kB", help="model data kept in host memory, e.g. 2GiB")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as offload_dir:
        plan = tessera.Plan(zero=3, block_chunks=True, offload="auto", host_memory=parse_bytes(args.host_memory),
                            offload_dir=offload_dir)  # fmt: skip
        with torch.device("meta"):  # the dry run needs shapes only: no memory, no weights
            shapes = build(args)
        print(memory_report(shapes, plan).text())
        losses, moved = train(args, plan)
    in_memory, _ = train(args, tessera.Plan(zero=3, block_chunks=True))
    print(f"offloaded: losses {[round(x, 5) for x in losses]}; {moved['fetches']} chunk fetches, "
          f"{(moved['read'] + moved['written']) / 2**20:.1f} MiB moved in {args.steps} steps")  # fmt: skip
    print(f"in memory: losses {[round(x, 5) for x in in_memory]}")
    if losses != in_memory:
        raise SystemExit("offloaded training differs from training in memory")
    print("bit-exact: the same losses with and without offload")


if __name__ == "__main__":
    main()
