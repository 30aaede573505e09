"""The hardware a prediction is for: a device profile at a dtype with an achieved fraction
of its peak, and a topology of nodes x devices with a link inside a node and one between
nodes.

Links as they are built (``LINK_TOPOLOGY``: each link profile's topology and its source).
NVLink 3/4 nodes are NVSwitch nodes: every GPU pair at the full per-GPU NVLink rate, so a
collective's ranks do not share bandwidth. PCIe GPUs sit behind PCIe switches (or a host
bridge) whose one x16 uplink carries everything that leaves the switch: with
``pcie_group=s`` (s GPUs per switch; 0, the default, when the server's layout is not known)
an all-to-all whose n ranks of a node span switches, u of them below the busiest, pushes
u (n - u) / n of a GPU's bytes through that switch's one uplink, so it takes u (n - u) /
(n - 1) times the independent-sends time when that is larger (8 GPUs, 4 per switch: 2.29x). A ring laid out in rank order crosses each uplink once
per direction, so its passes (ring attention's sends, ring all-gather / reduce-scatter /
all-reduce) do not share it. Between nodes: one NIC per GPU (rail-optimised), non-blocking.

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

# Each link profile of tessera.runtime.link: how the devices it joins are wired, and where that
# is stated.
LINK_TOPOLOGY: dict[str, tuple[str, str]] = {
    "nvlink3": ("NVSwitch: 8 A100s, every pair at full NVLink rate", "NVIDIA DGX A100 system architecture"),
    "nvlink4": (
        "NVSwitch: 8 H100s, every pair at full NVLink rate",
        "NVIDIA DGX H100 / HGX H100 architecture",
    ),
    "pcie4": (
        "PCIe 4.0 x16 per GPU; GPUs behind a PCIe switch share its x16 uplink (--pcie-group)",
        "PCI-SIG PCIe 4.0; GPUs per switch are the server's (not stated by the published tables)",
    ),
    "pcie5": (
        "PCIe 5.0 x16 per GPU; GPUs behind a PCIe switch share its x16 uplink (--pcie-group)",
        "PCI-SIG PCIe 5.0; GPUs per switch are the server's",
    ),
    "ib-hdr": ("one 200 Gb/s port per GPU, non-blocking fat tree (assumed)", "NVIDIA ConnectX-6 HDR"),
    "ethernet-25g": ("one 25 GbE port per node, non-blocking switch (assumed)", "IEEE 802.3by"),
    "ethernet-100g": ("one 100 GbE port per node, non-blocking switch (assumed)", "IEEE 802.3ba"),
}


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
    # GPUs behind one PCIe switch sharing its x16 uplink (0: not modelled, or a switched
    # fabric such as NVSwitch). Only meaningful for a PCIe ``link``.
    pcie_group: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.pcie_group, int) or self.pcie_group < 0:
            raise ValueError(
                f"pcie_group must be an integer >= 0 (GPUs per PCIe switch), got {self.pcie_group!r}"
            )
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
        link = self.link_between(ranks)
        seconds = link.seconds(op, int(num_bytes), len(ranks))
        return seconds * self.uplink_factor(op, ranks) if link is self.link else seconds

    def uplink_factor(self, op: str, ranks) -> float:
        """How many times longer ``op`` over ``ranks`` (one node's) takes because the GPUs
        behind one PCIe switch share its uplink: s (n - s) / (n - 1) for an all-to-all over n
        ranks spanning switches of s (when above 1); 1 for ring passes and when
        ``pcie_group`` is 0."""
        n, s = len(ranks), self.pcie_group
        if op != "all_to_all" or not s:
            return 1.0
        switches: dict[int, int] = {}
        for r in ranks:
            switches[(r % self.devices_per_node) // s] = switches.get((r % self.devices_per_node) // s, 0) + 1
        under = max(switches.values())  # the busiest switch's ranks in this group
        return max(1.0, under * (n - under) / (n - 1))
