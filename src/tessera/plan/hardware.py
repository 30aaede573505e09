"""The hardware a prediction is for: a device profile at a dtype with an achieved fraction
of its peak, and a topology of nodes x devices with a link inside a node and one between
nodes.

Compute time of an operation is ``flops / (peak * efficiency)`` (memory-bound work:
``bytes / bandwidth``). ``efficiency`` is what a real kernel mix reaches of the datasheet
peak; the checks calibrate it once per table from the one-device row (see
tessera.plan.published) and predict every parallel row from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.plan.devices import DeviceProfile
from tessera.runtime.link import Link

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class Hardware:
    device: DeviceProfile
    link: Link  # between two devices of a node
    devices_per_node: int = 8
    inter_node: Link | None = None  # between nodes (None: one node)
    precision: str = "bf16"  # the one name for it, as Plan and the command line say
    efficiency: float = 0.5
    # Host seconds to dispatch one eager op (PyTorch's dispatcher + the launch): kernels are
    # asynchronous, so a layer takes at least its op count times this (0: not modelled).
    host_op_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.precision not in DTYPE_BYTES:
            raise ValueError(f"precision {self.precision!r} is not one of {tuple(DTYPE_BYTES)}")
        if not self.efficiency > 0:  # above 1 only in checks, where it says the peak or FLOPs are off
            raise ValueError(f"efficiency must be > 0, got {self.efficiency!r}")
        if self.host_op_seconds < 0:
            raise ValueError(f"host_op_seconds must be >= 0, got {self.host_op_seconds!r}")
        if self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node}")

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.precision]

    @property
    def flops(self) -> float:
        peak = self.device.fp32_flops if self.precision == "fp32" else self.device.bf16_flops
        return peak * self.efficiency

    def compute_seconds(self, flops: float) -> float:
        return flops / self.flops

    def memory_seconds(self, num_bytes: float) -> float:
        return num_bytes / self.device.memory_bandwidth

    def link_between(self, ranks) -> Link:
        """The slowest link a collective over ``ranks`` crosses (global rank ids, packed
        devices_per_node to a node)."""
        nodes = {r // self.devices_per_node for r in ranks}
        if len(nodes) > 1:
            if self.inter_node is None:
                raise ValueError(
                    f"ranks {sorted(ranks)} span {len(nodes)} nodes of {self.devices_per_node} devices, "
                    "but no inter-node link was given"
                )
            return self.inter_node
        return self.link

    def comm_seconds(self, op: str, num_bytes: float, ranks) -> float:
        ranks = tuple(ranks)
        if len(ranks) < 2:
            return 0.0
        return self.link_between(ranks).seconds(op, int(num_bytes), len(ranks))
