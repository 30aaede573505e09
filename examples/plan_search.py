"""Plan: ask the planner for the best inference and training plans on named hardware.

    python examples/plan_search.py
    python examples/plan_search.py --dit pixart-alpha --lm gpt2-xl --devices 8 --device a100 --link pcie4

The planner (tessera.plan; see docs/plan.md) predicts one image's sampling time and one
training step's time under every valid plan, from a cost model (FLOPs and bytes per layer
against a device profile and a link profile) and an op-level simulator, drops the plans that
do not fit the device's memory, and ranks the rest. The same search runs behind
`tessera plan generate` and `tessera plan train`; here it is called as a library, on the
presets of tessera.plan.model_spec.
"""

import argparse

from tessera.plan.devices import device_named
from tessera.plan.hardware import Hardware
from tessera.plan.model_presets import PRESETS
from tessera.plan.model_spec import model_spec
from tessera.plan.search import search_generate, search_train
from tessera.plan.training import describe
from tessera.runtime.link import link_named

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dit", default="bench-dit", help=f"a DiT preset ({', '.join(PRESETS)})")
    parser.add_argument("--lm", default="gpt2-xl", help="a language model preset")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--device", default="l40", help="device profile: h100, a100, l40, ...")
    parser.add_argument("--link", default="pcie4", help="link between the devices: pcie4, nvlink4, ...")
    parser.add_argument("--steps", type=int, default=10, help="sampling steps")
    parser.add_argument("--global-batch", type=int, default=32, help="training samples per step")
    parser.add_argument("--top", type=int, default=3, help="plans to print")
    args = parser.parse_args()

    hw = Hardware(device=device_named(args.device), link=link_named(args.link), devices_per_node=args.devices)
    where = f"{args.devices} x {hw.device.name} over {hw.link.name}"

    dit = model_spec(args.dit)
    ranked = search_generate(dit, args.devices, hw, steps=args.steps)
    print(f"{dit.name}, {dit.tokens} tokens, {args.steps} steps on {where}:")
    for p in ranked.fits[: args.top]:
        print(
            f"  {p.config.describe():<50} {p.seconds:8.3f} s  {p.memory_bytes_per_rank / GIB:6.1f} GiB/rank"
        )

    lm = model_spec(args.lm)
    ranked = search_train(lm, args.devices, hw, global_batch=args.global_batch, seq=lm.tokens)
    print(
        f"{lm.name}, {lm.total_params / 1e6:,.0f}M parameters, batch {args.global_batch} x {lm.tokens} on {where}:"
    )
    for p in ranked.fits[: args.top]:
        print(f"  {describe(p.plan):<50} {p.seconds:8.3f} s  {p.memory_bytes_per_rank / GIB:6.1f} GiB/rank")
    if not ranked.fits:
        print(f"  no plan fits: {len(ranked.dropped)} over the device's memory")


if __name__ == "__main__":
    main()
