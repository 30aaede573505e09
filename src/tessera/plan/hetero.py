"""Training with the model data spread over GPU and CPU memory (PatrickStar, Colossal-AI's
Gemini, DeepSpeed's ZeRO-Offload) and plain data parallel, as formulas: the bytes each keeps
where, the largest model that fits, and the time of one step. Used to check the planner
against the scale figures PatrickStar and Colossal-AI publish (tessera.plan.published_scale).

Model data per parameter of mixed-precision Adam (fp16 compute, fp32 master), N GPUs:

  system        GPU (each)                         CPU (the node's)        source
  pytorch-ddp   22: fp32 param 4, fp32 grad 4,     0                       torch.cuda.amp keeps fp32
                Adam m, v 8, DDP's bucket copy of                          weights (Micikevicius et al.
                the grads 4, autocast's fp16                               2018); DDP docs
                weight cache 2                                             (gradient_as_bucket_view off)
  zero-offload  4 / N: fp16 param and grad,        14: fp32 param, m, v,   Ren et al. 2021 (ZeRO-Offload),
                partitioned (ZeRO-3)               fp16 grad               on ZeRO-3
  chunk         14 in all, anywhere: fp16 param chunks (a gradient is      PatrickStar INSIDE.md
                written into its parameter's chunk) 2, fp32 param, m, v 12;
                the GPUs hold what their non-model data leaves (param chunks
                first, optimizer chunks with what is left: "hybrid Adam"),
                within the shares of ChunkBudget (PatrickStar v0.4.3's: 80% of
                each memory, 10% of the GPU's share in the warm-up iteration)

Non-model data on each GPU: activations with checkpointing (tessera.plan.training's
formula, fp16) and, for the chunk systems, the chunks in flight (two chunks of every rank:
the gathered group and the next, prefetched). DeepSpeed's example keeps its activation
checkpoints in CPU memory (``--checkpoint-in-cpu``), so only one block's activations stay.

One step (per GPU; t_c = the FLOPs at the calibrated efficiency):

    step = t_c + PCIe bytes / PCIe bandwidth + CPU Adam + GPU Adam          (chunk)
    step = max(t_c, PCIe bytes / PCIe bandwidth) + CPU Adam                  (zero-offload)

PatrickStar's benchmark runs with chunk moves synchronous (``ASYNC_MOVE=0``, the default of
examples/run_transformers.sh), so its transfers add to the compute; ZeRO-Offload overlaps
the gradient offload with the backward (Ren et al. 2021).

PCIe bytes of a chunk system: the fp16 parameter chunks that do not fit move in for the
forward and the backward and their gradients out (3 x 2 bytes), and every parameter whose
optimizer state lives on the CPU sends its fp16 gradient out and gets its fp16 parameter
back (2 x 2 bytes). Adam reads and writes fp32 param, m and v, reads the fp16 gradient and
writes the fp16 parameter: 28 bytes an element, at the CPU's or the GPU's memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.plan.model_spec import TransformerSpec
from tessera.plan.training import activation_bytes
from tessera.plan.training_plan import Plan

SYSTEMS = ("pytorch-ddp", "zero-offload", "chunk")
CHUNK_STATE_BYTES = 14  # fp16 param/grad chunk 2 + fp32 param, m, v 12 (PatrickStar INSIDE.md)
PARAM_CHUNK_BYTES = 2
OPTIMIZER_BYTES = 12
DDP_GPU_BYTES = 22
ZERO_OFFLOAD_GPU_BYTES = 4  # partitioned over the GPUs
ZERO_OFFLOAD_CPU_BYTES = 14
ADAM_BYTES = 28  # read 4+4+4+2, write 4+4+4+2 per element
FLOPS_PER_PARAM_TOKEN = 8  # forward 2, backward 4, recompute 2: PatrickStar's own TFLOPS count


@dataclass(frozen=True, kw_only=True)
class ChunkBudget:
    """How much of each memory a chunk system lets its chunks use. PatrickStar's memory
    tracer (patrickstar/core/memtracer/memtracer.py) gives chunks ``gpu_ratio`` of the GPU
    (less the non-model data it traced) and ``cpu_ratio`` of the CPU, but during the warm-up
    iteration's forward and backward only ``warmup_gpu_ratio`` of that GPU share, so the
    warm-up must fit the rest in CPU memory; optimizer chunks go to the GPU with
    ``margin_use_ratio`` of the GPU memory the fp16 chunks leave."""

    gpu_ratio: float = 1.0
    cpu_ratio: float = 1.0
    warmup_gpu_ratio: float = 1.0
    margin_use_ratio: float = 1.0


# The config PatrickStar's benchmark ran with at v0.4.3, the version its figures name
# (Tencent/PatrickStar@v0.4.3 examples/pretrain_bert_demo.py, "mem_tracer"; later versions'
# examples/ps_config.py raise the first two to 0.9)
PATRICKSTAR_BUDGET = ChunkBudget(gpu_ratio=0.8, cpu_ratio=0.8, warmup_gpu_ratio=0.1, margin_use_ratio=0.8)


@dataclass(frozen=True, kw_only=True)
class Node:
    """One machine: ``gpus`` devices of ``gpu_bytes`` each and a CPU memory shared by all."""

    gpus: int
    gpu_bytes: float
    cpu_bytes: float
    gpu_flops: float = 0.0  # fp16 tensor peak per GPU
    gpu_bandwidth: float = 1.0  # bytes/s
    pcie_bandwidth: float = 1.0  # bytes/s per GPU, each direction
    cpu_bandwidth: float = 1.0  # bytes/s of the node's memory
    chunk_bytes: float = 2 * 64 * 2**20  # PatrickStar's default: 64 M fp16 elements
    budget: ChunkBudget = ChunkBudget()  # the chunk system's shares of each memory

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpu_bytes <= 0 or self.cpu_bytes < 0:
            raise ValueError(f"a node needs gpus >= 1, gpu_bytes > 0, cpu_bytes >= 0; got {self}")


def non_model_bytes(spec: TransformerSpec, system: str, batch: int, seq: int, node: Node) -> float:
    """Per GPU: activations (checkpointing on, fp16) and the chunk buffers."""
    c = Plan(dp=1, activation_checkpointing=True)
    acts = activation_bytes(spec, c, batch, seq, 2)
    if system == "zero-offload":  # checkpoints in CPU memory: one block's activations remain
        acts -= spec.layers * 2 * seq * batch * spec.hidden
    if system == "chunk":
        acts += 2 * node.gpus * node.chunk_bytes
    return acts


def placement(spec: TransformerSpec, system: str, batch: int, seq: int, node: Node) -> dict[str, float]:
    """Bytes of model data on the GPUs (all of them) and the CPU, and what does not fit
    (``over``: > 0 means the model does not fit)."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    p, n = spec.total_params, node.gpus
    room = n * max(0.0, node.gpu_bytes - non_model_bytes(spec, system, batch, seq, node))
    if system == "pytorch-ddp":
        need = n * DDP_GPU_BYTES * p
        return {"gpu": need, "cpu": 0.0, "over": max(0.0, need - room)}
    if system == "zero-offload":
        gpu, cpu = ZERO_OFFLOAD_GPU_BYTES * p, ZERO_OFFLOAD_CPU_BYTES * p
        cpu += n * spec.layers * 2 * seq * batch * spec.hidden  # the activation checkpoints
        return {"gpu": gpu, "cpu": cpu, "over": max(0.0, gpu - room) + max(0.0, cpu - node.cpu_bytes)}
    steady, warmup, cpu = _chunk_rooms(spec, batch, seq, node)
    total = CHUNK_STATE_BYTES * p
    gpu = min(total, steady)
    return {"gpu": gpu, "cpu": total - gpu, "over": max(0.0, total - cpu - min(steady, warmup))}


def _chunk_rooms(spec: TransformerSpec, batch: int, seq: int, node: Node) -> tuple[float, float, float]:
    """Chunk bytes the GPUs hold in steady state and in the warm-up iteration, and the CPU's."""
    b, n = node.budget, node.gpus
    share = b.gpu_ratio * node.gpu_bytes
    steady = n * max(0.0, share - non_model_bytes(spec, "chunk", batch, seq, node))
    return steady, n * b.warmup_gpu_ratio * share, b.cpu_ratio * node.cpu_bytes


def fits(spec: TransformerSpec, system: str, batch: int, seq: int, node: Node) -> bool:
    return placement(spec, system, batch, seq, node)["over"] <= 0


def capacity_params(spec: TransformerSpec, system: str, batch: int, seq: int, node: Node) -> float:
    """The most parameters of ``spec``'s shape (its non-model data held fixed) that fit."""
    n = node.gpus
    room = n * max(0.0, node.gpu_bytes - non_model_bytes(spec, system, batch, seq, node))
    if system == "pytorch-ddp":
        return room / (n * DDP_GPU_BYTES)
    if system == "zero-offload":
        ckpt = n * spec.layers * 2 * seq * batch * spec.hidden
        return min(room / ZERO_OFFLOAD_GPU_BYTES, max(0.0, node.cpu_bytes - ckpt) / ZERO_OFFLOAD_CPU_BYTES)
    steady, warmup, cpu = _chunk_rooms(spec, batch, seq, node)
    return (cpu + min(steady, warmup)) / CHUNK_STATE_BYTES


def step_seconds(
    spec: TransformerSpec, system: str, batch: int, seq: int, node: Node, efficiency: float
) -> dict[str, float]:
    """One step's parts per GPU (seconds) for ``batch`` samples per GPU."""
    p, n = spec.total_params, node.gpus
    compute = FLOPS_PER_PARAM_TOKEN * p * batch * seq / (node.gpu_flops * efficiency)
    if system == "pytorch-ddp":
        return {
            "compute": compute,
            "pcie": 0.0,
            "cpu_adam": 0.0,
            "gpu_adam": ADAM_BYTES * p / node.gpu_bandwidth,
        }
    if system == "zero-offload":
        pcie = 2 * PARAM_CHUNK_BYTES * p / n  # fp16 grads out, fp16 params back (the rank's shard)
        return {"compute": compute, "pcie": pcie / node.pcie_bandwidth, "cpu_adam": ADAM_BYTES * p / node.cpu_bandwidth, "gpu_adam": 0.0}  # fmt: skip
    room = placement(spec, system, batch, seq, node)["gpu"]
    params_off = max(0.0, PARAM_CHUNK_BYTES * p - room) / PARAM_CHUNK_BYTES  # elements
    margin = node.budget.margin_use_ratio * max(0.0, room - PARAM_CHUNK_BYTES * p)
    os_gpu = min(p, margin / OPTIMIZER_BYTES)  # elements
    os_cpu = p - os_gpu
    pcie = (3 * PARAM_CHUNK_BYTES * params_off + 2 * PARAM_CHUNK_BYTES * os_cpu) / n
    return {
        "compute": compute,
        "pcie": pcie / node.pcie_bandwidth,
        "cpu_adam": ADAM_BYTES * os_cpu / node.cpu_bandwidth,
        "gpu_adam": ADAM_BYTES * os_gpu / n / node.gpu_bandwidth,
        "overlap": 0.0,  # chunk moves synchronous (ASYNC_MOVE=0)
    }


def step_total(parts: dict[str, float]) -> float:
    if parts.get("overlap", 1.0):
        moving = max(parts["compute"], parts["pcie"])
    else:
        moving = parts["compute"] + parts["pcie"]
    return moving + parts["cpu_adam"] + parts["gpu_adam"]


def tflops_total(
    spec: TransformerSpec, system: str, batch: int, seq: int, node: Node, efficiency: float
) -> float:
    """TFLOP/s of the whole node, counted as PatrickStar counts (8 P B S per GPU a step)."""
    seconds = step_total(step_seconds(spec, system, batch, seq, node, efficiency))
    return node.gpus * FLOPS_PER_PARAM_TOKEN * spec.total_params * batch * seq / seconds / 1e12


def calibrate_efficiency(spec, system: str, batch: int, seq: int, node: Node, tflops: float) -> float:
    """The efficiency at which ``tflops_total`` gives ``tflops`` (bisection: it is monotone)."""
    lo, hi = 1e-4, 4.0
    for _ in range(80):
        mid = (lo * hi) ** 0.5
        if tflops_total(spec, system, batch, seq, node, mid) < tflops:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5
