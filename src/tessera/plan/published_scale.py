"""Scale figures PatrickStar and Colossal-AI publish, as data: the largest model each system
trained on stated hardware, and throughput. Every labelled number of the figures below is
here, good rows and bad; rows whose hardware the source does not state are listed with
``predictable=False`` and the reason (their implied host memory is reported instead).

Sources (each row names its own):
  PS_V100  github.com/Tencent/PatrickStar@2384535 doc/mgpu_scalability.png, "Evaluation on
           8xV100 240GB CPU on a Node at WeChat Yard" (README: v0.4.3, 18B on 8 V100; DeepSpeed
           v0.4.3 with the Megatron-LM-v1.1.5-ZeRO3 example); V100-SXM2-32GB per
           doc/yard_network_fabric.md. Model ladder: examples/model_builder.py (GPT2_1B ...
           GPT3_18B; seq 1024).
  PS_A100  same repo, doc/one_node_perf_a100.png, "Evaluation on 8xA100 1TB Memory SuperPod
           Node" (DeepSpeed v0.5.7). 1 TB is a DGX A100 320GB node (8 x A100 40GB; the 640GB
           DGX has 2 TB: NVIDIA DGX A100 datasheet). Ladder: GPT3_6B ... GPT_DS_68B; the repo
           has no 30B config, so 30B is h 8192 x 37 layers by the GPT_DS ladder's 12 h^2 L.
  PS_NODES same repo, README + doc/m_node_superpod.png: GPT3-175B trained on 32 A100 (4 nodes).
  CAI_1GPU github.com/hpcaitech/public_assets colossalai/img/GPT2-GPU1.png (ColossalAI README
           "Single GPU Training Demo"): GPT-2 on RTX 2060 6G / 2080Ti 11G / 3090 24G / V100 32G.
  CAI_3080 public_assets colossalai/img/GPT2-NVME.png ("120x larger model size on the same
           hardware (RTX 3080)"); throughput bars without units.
  CAI_BENCH github.com/hpcaitech/ColossalAI README "Colossal-AI Benchmark" table (H200/B200).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.plan.hetero import PATRICKSTAR_BUDGET, Node
from tessera.plan.model_spec import TransformerSpec, gpt2_spec

GB, GIB = 1e9, 2**30
PS = "Tencent/PatrickStar@2384535"
PS_V100 = f"{PS} doc/mgpu_scalability.png"
PS_A100 = f"{PS} doc/one_node_perf_a100.png"
CAI_ASSETS = "hpcaitech/public_assets colossalai/img"

# Host-side rates the sources do not state, assumed and named in every row that uses them:
# V100-SXM2 is PCIe Gen3 x16 (NVIDIA V100 datasheet), 15.75 GB/s raw, ~80% sustained; DGX A100
# is PCIe Gen4 (25 GB/s as tessera.runtime.link's pcie4). CPU memory bandwidth: DGX A100 has
# 2 AMD EPYC 7742 (8 channels of DDR4-3200 each: 2 x 204.8 GB/s), ~70% sustained = 287 GB/s;
# the WeChat node's CPU is not stated: a 2-socket, 6-channel DDR4-2666 Xeon (2 x 128 GB/s) at
# ~70% = 180 GB/s is assumed.
V100_NODE = Node(
    gpus=8, gpu_bytes=32 * GIB, cpu_bytes=240 * GB, gpu_flops=125e12, gpu_bandwidth=900 * GB,
    pcie_bandwidth=12.6 * GB, cpu_bandwidth=180 * GB, budget=PATRICKSTAR_BUDGET,
)  # fmt: skip
A100_NODE = Node(
    gpus=8, gpu_bytes=40 * GIB, cpu_bytes=1000 * GB, gpu_flops=312e12, gpu_bandwidth=1555 * GB,
    pcie_bandwidth=25 * GB, cpu_bandwidth=287 * GB, budget=PATRICKSTAR_BUDGET,
)  # fmt: skip
HOST_ASSUMPTIONS = (
    "not stated by the source, assumed: PCIe 12.6 GB/s (V100, Gen3) / 25 GB/s (A100, Gen4) per GPU; "
    "CPU memory 180 GB/s (WeChat node) / 287 GB/s (DGX A100); batch 4 per GPU for capacity, 8 for throughput"
)


def _ps_gpt(label: str, hidden: int, layers: int) -> TransformerSpec:
    # PatrickStar's GPT configs: 16 heads, seq 1024, GPT-2 vocabulary (GPT2ForSequenceClassification)
    return gpt2_spec(f"ps-gpt-{label}", layers, hidden, 16, tokens=1024, positions=1024)


V100_LADDER = {
    1: _ps_gpt("1B", 2048, 20), 2: _ps_gpt("2B", 2048, 40), 4: _ps_gpt("4B", 2304, 64),
    6: _ps_gpt("6B", 3072, 53), 8: _ps_gpt("8B", 3072, 72), 10: _ps_gpt("10B", 4096, 50),
    12: _ps_gpt("12B", 4096, 60), 15: _ps_gpt("15B", 4096, 78), 18: _ps_gpt("18B", 4096, 90),
}  # fmt: skip
A100_LADDER = {
    6: V100_LADDER[6], 10: V100_LADDER[10], 15: V100_LADDER[15], 20: _ps_gpt("20B", 8192, 25),
    30: _ps_gpt("30B", 8192, 37), 40: _ps_gpt("40B", 8192, 50), 50: _ps_gpt("50B", 8192, 62),
    60: _ps_gpt("60B", 8192, 75), 68: _ps_gpt("68B", 9216, 66),
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class CapacityRow:
    """The largest model ``label`` trained on ``gpus`` GPUs of ``node``: ``published``
    billions; ``next_size`` the next size of the source's ladder (None: the ladder's top or
    no ladder, so the published size is only a lower bound)."""

    group: str
    label: str  # the source's name for the system
    system: str  # tessera.plan.hetero.SYSTEMS
    gpus: int
    published: float
    next_size: float | None
    node: Node
    ladder: dict[int, TransformerSpec] | None
    source: str
    predictable: bool = True
    batch: int = 4  # per GPU, seq 1024, checkpointing on
    note: str = ""


def _ps_rows() -> list[CapacityRow]:
    rows = []
    v100 = {  # (label, system): largest per GPU count 1, 2, 4, 8 (the figure's last points)
        ("pstar", "chunk"): (12, 12, 12, 18),
        ("deeps", "zero-offload"): (4, 6, 6, 4),
        ("torch", "pytorch-ddp"): (1, 1, 1, 1),
    }
    sizes = sorted(V100_LADDER)
    for (label, system), maxima in v100.items():
        for gpus, top in zip((1, 2, 4, 8), maxima, strict=True):
            nxt = sizes[sizes.index(top) + 1] if top != sizes[-1] else None
            rows.append(CapacityRow(
                group="PatrickStar, 8xV100-32GB + 240 GB CPU (WeChat)", label=f"{label}-{gpus}-gpu",
                system=system, gpus=gpus, published=top, next_size=nxt, node=V100_NODE, ladder=V100_LADDER,
                source=PS_V100,
            ))  # fmt: skip
    for label in ("deeps-mp2-8-gpu", "deeps-mp4-8-gpu"):  # DeepSpeed with Megatron TP 2 / 4
        rows.append(CapacityRow(
            group="PatrickStar, 8xV100-32GB + 240 GB CPU (WeChat)", label=label, system="zero-offload",
            gpus=8, published=8, next_size=10, node=V100_NODE, ladder=V100_LADDER, source=PS_V100,
            note="TP splits the same bytes over the same 8 GPUs: predicted as deeps-8-gpu",
        ))  # fmt: skip
    sizes = sorted(A100_LADDER)
    a100 = {("pstar", "chunk"): (50, 50, 60, 68), ("deeps", "zero-offload"): (15, 20, 20, 30)}
    for (label, system), maxima in a100.items():
        for gpus, top in zip((1, 2, 4, 8), maxima, strict=True):
            nxt = sizes[sizes.index(top) + 1] if top != sizes[-1] else None
            rows.append(CapacityRow(
                group="PatrickStar, 8xA100-40GB + 1 TB CPU (SuperPod node)", label=f"{label}-{gpus}-gpu",
                system=system, gpus=gpus, published=top, next_size=nxt, node=A100_NODE, ladder=A100_LADDER,
                source=PS_A100,
            ))  # fmt: skip
    rows.append(CapacityRow(
        group="PatrickStar, 4 SuperPod nodes (32xA100-40GB + 4 TB CPU)", label="pstar-32-gpu GPT3-175B",
        system="chunk", gpus=32, published=175, next_size=None,
        node=Node(gpus=32, gpu_bytes=40 * GIB, cpu_bytes=4000 * GB, budget=PATRICKSTAR_BUDGET), ladder={175: gpt2_spec(
            "gpt3-175b", 96, 12288, 96, tokens=1024, positions=1024)},
        source=f"{PS} README ('GPT3-175B on 32 GPU') + doc/m_node_superpod.png",
        note="a trained size, not a stated maximum",
    ))  # fmt: skip
    return rows


def _cai_rows() -> list[CapacityRow]:
    """ColossalAI's single-GPU figures: the GPU is named, the host memory is not, so only the
    GPU-only (PyTorch) rows are predictable."""
    gpt2 = None  # the figures do not give the GPT-2 configs: tessera.plan.check_scale picks a shape
    rows = []
    gpus = {"RTX 2060 6G": 6, "RTX 2080Ti 11G": 11, "RTX 3090 24G": 24, "V100 32G": 32}
    published = {
        "PyTorch": (0.10, 0.10, 1.00, 1.50),
        "DeepSpeed": (0.33, 0.38, 6.00, 12.00),
        "Colossal-AI": (1.50, 2.00, 18.00, 24.00),
    }
    systems = {"PyTorch": "pytorch-ddp", "DeepSpeed": "zero-offload", "Colossal-AI": "chunk"}
    for label, values in published.items():
        for (gpu, gib), value in zip(gpus.items(), values, strict=True):
            rows.append(CapacityRow(
                group=f"Colossal-AI GPT-2, 1x {gpu}", label=label, system=systems[label], gpus=1,
                published=value, next_size=None, node=Node(gpus=1, gpu_bytes=gib * GIB, cpu_bytes=0.0),
                ladder=gpt2, source=f"{CAI_ASSETS}/GPT2-GPU1.png", predictable=label == "PyTorch", batch=1,
                note="" if label == "PyTorch" else "host memory not stated: implied host memory reported",
            ))  # fmt: skip
    for label, system, value in (
        ("PyTorch", "pytorch-ddp", 0.1), ("DeepSpeed", "zero-offload", 1.5), ("DeepSpeed (NVMe)", "zero-offload", 4.0),
        ("Colossal-AI (ZeRO+Gemini)", "chunk", 6.0), ("Colossal-AI (ZeRO+Gemini+NVMe)", "chunk", 12.0),
    ):  # fmt: skip
        rows.append(CapacityRow(
            group="Colossal-AI GPT-2, 1x RTX 3080 10G", label=label, system=system, gpus=1, published=value,
            next_size=None, node=Node(gpus=1, gpu_bytes=10 * GIB, cpu_bytes=0.0), ladder=gpt2,
            source=f"{CAI_ASSETS}/GPT2-NVME.png", predictable=label == "PyTorch", batch=1,
            note="" if label == "PyTorch" else "host memory and NVMe not stated: implied host memory reported",
        ))  # fmt: skip
    return rows


def capacity_rows() -> list[CapacityRow]:
    return _ps_rows() + _cai_rows()


@dataclass(frozen=True, kw_only=True)
class ThroughputSeries:
    """Node TFLOP/s (PatrickStar's count, 8 P B S per GPU a step) of ``system`` on ``gpus``
    GPUs over the ladder; the first point calibrates the efficiency."""

    name: str
    system: str
    gpus: int
    node: Node
    ladder: dict[int, TransformerSpec]
    points: tuple[tuple[int, float], ...]  # (ladder size in B, published TFLOP/s)
    source: str
    note: str = ""


V100_TFLOPS = {
    1: (54.60, 50.57, 48.39, 46.31, 42.24, 45.69, 33.78),
    2: (107.46, 100.21, 93.91, 103.51, 83.92, 86.54, 75.52),
    4: (221.74, 212.31, 208.49, 232.94, 211.96, 237.25, 224.59),
    8: (444, 425, 426, 482, 467, 494, 482, 465, 419),
}
A100_TFLOPS = {  # "~": the label is partly hidden by another line's in the figure
    ("pstar", 1): (114, 118, 113, 93, 57, 56, 67),
    ("pstar", 2): (237, 266, 210, 167, 137, 137, 134),
    ("pstar", 4): (534, 587, 519, 585, 524, 367, 368, 333),
    ("pstar", 8): (1180, 1218, 1134, 1231, 1132, 1109, 952, 920, 857),
    ("deeps", 1): (83.6, 87.6, 80.7),
    ("deeps", 2): (170, 181, 161, 155),
    ("deeps", 4): (374, 341, 338, 241),
    ("deeps", 8): (728, 725, 773, 865, 578),
}
PARTLY_HIDDEN = (
    "labels partly hidden in the figure, read as: pstar-4 10B 587, 30B 524; deeps-2 20B 155; deeps-8 10B 725"
)


def throughput_series() -> list[ThroughputSeries]:
    out = []
    sizes = sorted(V100_LADDER)
    for gpus, values in V100_TFLOPS.items():
        out.append(ThroughputSeries(
            name=f"PatrickStar V100 pstar-{gpus}-gpu", system="chunk", gpus=gpus, node=V100_NODE,
            ladder=V100_LADDER, points=tuple(zip(sizes, values, strict=False)), source=PS_V100,
        ))  # fmt: skip
    sizes = sorted(A100_LADDER)
    for (label, gpus), values in A100_TFLOPS.items():
        out.append(ThroughputSeries(
            name=f"PatrickStar A100 {label}-{gpus}-gpu", system="chunk" if label == "pstar" else "zero-offload",
            gpus=gpus, node=A100_NODE, ladder=A100_LADDER, points=tuple(zip(sizes, values, strict=False)), source=PS_A100,
            note=PARTLY_HIDDEN if (label, gpus) in {("pstar", 4), ("deeps", 2), ("deeps", 8)} else "",
        ))  # fmt: skip
    return out


# ColossalAI README "Colossal-AI Benchmark": Llama-like models, seq 4096. Rows 3 and 4 use
# zero1(dp2)+tp2+pp4, a plan the simulator does not compose (tp x pp): listed, not predicted.
# The 4th row says H200 at 811.79 TFLOPS/GPU, above what the 2nd row's H200 reached: likely B200.
CAI_BENCH = "hpcaitech/ColossalAI README 'Colossal-AI Benchmark' table"
CAI_BENCH_ROWS = (
    # (gpu, gpus, model, parallelism, batch per dp, samples/s, TFLOPS/GPU, predictable)
    ("h200", 8, "llama-7b", "zero2 dp8", 36, 17.13, 534.18, True),
    ("h200", 16, "llama-70b", "zero2 dp16", 48, 3.27, 469.1, True),
    ("b200", 8, "llama-7b", "zero1(dp2)+tp2+pp4", 128, 25.83, 805.69, False),
    ("h200 (B200?)", 16, "llama-70b", "zero1(dp2)+tp2+pp4", 128, 5.66, 811.79, False),
)
LLAMA = {
    # Llama 2 (Touvron et al. 2023): 7B h 4096 x 32 layers, MLP 11008 (gated: 1.5 x two matrices);
    # 70B h 8192 x 80, MLP 28672 with grouped K/V (8 of 64 heads): its smaller K, V are folded
    # into the MLP width (35888) so that a layer's parameters and FLOPs add up to the published
    # 69B (untied embedding and head: 2 x 32000 x 8192). Published totals 6.74B / 69B.
    "llama-7b": TransformerSpec(name="llama-7b", layers=32, hidden=4096, heads=32, ffn=16512, tokens=4096,
                                vocab=32000, params=6_740_000_000, source="Llama 2 paper"),
    "llama-70b": TransformerSpec(name="llama-70b", layers=80, hidden=8192, heads=64, ffn=35888, tokens=4096,
                                 vocab=32000, params=69_000_000_000, source="Llama 2 paper"),
}  # fmt: skip
