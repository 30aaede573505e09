"""Named link models: what a transfer would cost on a real interconnect.

On one machine every rank talks over loopback, where bytes are nearly free, so a method
that moves 50x more data than another looks no slower. A ``Link`` makes ``runtime.comm``
wait, after each transfer, until the time the transfer would have taken on the named link:

    time = hops * latency + wire_bytes / bandwidth

with the ring algorithms' per-rank wire bytes and hop counts (the bus-bandwidth factors of
NVIDIA's nccl-tests, doc/PERFORMANCE.md), n ranks on the axis and b the bytes the ledger
records for the call (see comm.py's byte convention):

    all_reduce      2(n-1)/n * b     2(n-1) hops
    all_gather      (n-1) * b        n-1 hops    (b: this rank's shard)
    reduce_scatter  (n-1)/n * b      n-1 hops    (b: this rank's full input)
    all_to_all      (n-1)/n * b      n-1 hops
    broadcast       b                n-1 hops    (pipelined ring)
    send            b                1 hop

Each rank's transfers share its link in issue order (one finishes before the next starts);
concurrent transfers on different mesh axes are not modelled as separate links.

Figures (per direction, per device). Raw rates are the specifications'; the bandwidths
used are the sustained rates quoted below, which is what a well-tuned collective reaches:

    pcie4          25 GB/s, 5 us    PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s raw
                                   (PCI-SIG PCIe 4.0 base spec); ~80% sustained
    pcie5          50 GB/s, 5 us    PCIe 5.0 x16: 63 GB/s raw (PCI-SIG PCIe 5.0); ~80% sustained
    nvlink3       240 GB/s, 2 us    A100 NVLink 3: 600 GB/s both directions = 300 per direction
                                   (NVIDIA A100 datasheet); ~80% sustained
    nvlink4       360 GB/s, 2 us    H100 SXM NVLink 4: 900 GB/s both directions = 450 per
                                   direction (NVIDIA H100 datasheet); ~80% sustained
    ib-hdr         22 GB/s, 2 us    InfiniBand HDR 200 Gb/s = 25 GB/s (NVIDIA ConnectX-6); ~90%
    ethernet-25g  2.8 GB/s, 20 us   25 GbE = 3.125 GB/s raw (IEEE 802.3by); ~90%; TCP latency
    ethernet-100g  11 GB/s, 10 us   100 GbE = 12.5 GB/s raw (IEEE 802.3ba); ~90%

``Link.scaled(factor)`` multiplies the bandwidth and divides the latency by ``factor``: a
CPU core computes ~1000x slower than a GPU, so to see the balance a GPU would see between
its compute and its link, a benchmark scales the link by (this core's measured FLOP/s) /
(the GPU's FLOP/s) and says so in its output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Link:
    name: str
    bandwidth: float  # bytes per second, per direction
    latency: float  # seconds per hop
    source: str = ""
    scale: float = 1.0  # time scale applied by `scaled` (1: the real link)

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(f"link {self.name!r} needs bandwidth > 0 and latency >= 0")

    def scaled(self, factor: float) -> Link:
        if not factor > 0:
            raise ValueError(f"a link scale factor must be > 0, got {factor!r}")
        return dataclasses.replace(
            self, bandwidth=self.bandwidth * factor, latency=self.latency / factor, scale=self.scale * factor
        )

    def seconds(self, op: str, num_bytes: int, ranks: int) -> float:
        """Emulated time of one call of ``op`` moving ``num_bytes`` (the ledger's count)
        on an axis of ``ranks`` ranks."""
        n = ranks
        wire, hops = {
            "all_reduce": (2 * (n - 1) / n * num_bytes, 2 * (n - 1)),
            "all_gather": ((n - 1) * num_bytes, n - 1),
            "reduce_scatter": ((n - 1) / n * num_bytes, n - 1),
            "all_to_all": ((n - 1) / n * num_bytes, n - 1),
            "broadcast": (num_bytes, n - 1),
            "send": (num_bytes, 1),
        }[op]
        return hops * self.latency + wire / self.bandwidth

    def describe(self) -> str:
        text = f"{self.name} ({self.bandwidth / 1e9:.4g} GB/s, {self.latency * 1e6:.3g} us per hop)"
        return text if self.scale == 1.0 else f"{text}, scaled x{self.scale:.3g}"


GB = 1e9
LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link(name="pcie4", bandwidth=25 * GB, latency=5e-6, source="PCI-SIG PCIe 4.0 x16, 31.5 GB/s raw"),
        Link(name="pcie5", bandwidth=50 * GB, latency=5e-6, source="PCI-SIG PCIe 5.0 x16, 63 GB/s raw"),
        Link(name="nvlink3", bandwidth=240 * GB, latency=2e-6, source="NVIDIA A100 datasheet, 600 GB/s"),
        Link(name="nvlink4", bandwidth=360 * GB, latency=2e-6, source="NVIDIA H100 datasheet, 900 GB/s"),
        Link(name="ib-hdr", bandwidth=22 * GB, latency=2e-6, source="InfiniBand HDR 200 Gb/s"),
        Link(name="ethernet-25g", bandwidth=2.8 * GB, latency=20e-6, source="IEEE 802.3by 25 GbE"),
        Link(name="ethernet-100g", bandwidth=11 * GB, latency=10e-6, source="IEEE 802.3ba 100 GbE"),
    )
}


def link_named(name: str) -> Link:
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}; choose one of {', '.join(LINKS)}")
    return LINKS[name]
