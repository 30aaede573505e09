"""The configuration of `tessera bench train`: the GPT-2 sizes (full and ``--quick``), the
variants and their Tessera plans, and DeepSpeed's ZeRO-3 settings as its HuggingFace
integration derives them."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20
RANKS = 2
LR = 1e-4


@dataclass(frozen=True)
class TrainBenchConfig:
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    vocab: int = 50257
    seq: int = 128
    global_batch: int = 4
    warmup: int = 2
    steps: int = 20
    repeats: int = 3


FULL = TrainBenchConfig()
QUICK = TrainBenchConfig(
    n_embd=64, n_layer=2, n_head=4, vocab=512, seq=32, global_batch=4, warmup=1, steps=2, repeats=1
)
TESSERA = {  # variant -> Plan settings beside dp
    "tessera_dp": dict(zero=0, block_chunks=True),
    "tessera_zero1": dict(zero=1, block_chunks=True),
    "tessera_zero2": dict(zero=2, block_chunks=True),
    "tessera_zero3": dict(zero=3, block_chunks=True),
    "tessera_zero3_32mib": dict(zero=3, chunk_mib=32.0),
}
VARIANTS = ["ddp", "fsdp2", "deepspeed_zero3", *TESSERA]
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "tessera_dp"]  # stage 0 ~ DDP; on request
HEADLINE_STAGES = {1: "tessera_zero1", 2: "tessera_zero2", 3: "tessera_zero3"}


def deepspeed_config(cfg: TrainBenchConfig, micro_batch: int) -> dict:
    """ZeRO-3 as DeepSpeed's HuggingFace integration configures it for a model of hidden size
    h ("auto" values): reduce bucket h^2, prefetch bucket 0.9 h^2, parameters under 10 h
    elements kept whole; overlap_comm and contiguous_gradients on; live-parameter, reuse
    distance and sub-group limits at 1e9."""
    h = cfg.n_embd
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": int(1e9),
            "sub_group_size": int(1e9),
        },
    }
