"""DeepSpeed ZeRO-3 offload as ``tessera bench offload`` runs it: configured as its documentation
says for this model, built either way it offers (partitioned as it is built through
transformers' ``HfDeepSpeedConfig``, or whole), its CPU ops compiled once before any trial."""

from __future__ import annotations

import os
import subprocess
import sys
import time

MiB = 2**20


def have_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


def deepspeed_step(cfg, model_config, workdir, *, bf16: bool = False, whole: bool = False):
    import deepspeed
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from tessera.train.losses import causal_lm_loss

    nvme = AsyncIOBuilder().is_compatible(verbose=False)
    # sized like Tessera's chunks (cfg.chunk_mib): swap buffers, optimizer sub-groups, live
    # and prefetched parameters, so neither side is handed a larger working set
    elems = int(cfg.chunk_mib * MiB / 4)
    # DeepSpeed's documented NVMe settings (config-json, "Parameter offloading" and
    # "Optimizer offloading"), sized to this model: every swapped parameter takes one buffer
    # of buffer_size elements, so buffer_size must hold the largest (the token embedding,
    # one chunk here); its default count, 5, with room for the NVMe prefetch, which takes
    # only free buffers; max_in_cpu one chunk (the default 1e9 would keep the whole model in
    # host memory). The optimizer pool: at least the states per parameter (AdamW: parameter,
    # gradient, two moments = 4, the default). pin_memory off: page-locked memory buys no
    # DMA without a GPU, and counts against the memlock limit (the docs' advice there).
    if nvme:
        where = {"device": "nvme", "nvme_path": str(workdir), "pin_memory": False}
        param = {**where, "buffer_count": 8, "buffer_size": elems, "max_in_cpu": elems}
        optim = {**where, "buffer_count": 4}
    else:
        param = optim = {"device": "cpu", "pin_memory": False}
    config = {
        "train_micro_batch_size_per_gpu": cfg.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": bf16},  # bf16 parameters and compute, fp32 master copies (its docs)
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "zero_optimization": {
            "stage": 3, "offload_param": param, "offload_optimizer": dict(optim), "sub_group_size": elems,
            "stage3_max_live_parameters": 2 * elems, "stage3_prefetch_bucket_size": elems,
            # the default reuse distance (1e9 elements) keeps nearly every parameter after use;
            # on NVMe each one kept holds a swap buffer, and the pool runs dry ("Not enough
            # buffers 0 for swapping 1" at depth 8 in the first run: DeepSpeed issue #3062).
            # One chunk's worth, like the rest of this configuration
            "stage3_max_reuse_distance": elems,
            "stage3_param_persistence_threshold": 10 * cfg.width, "reduce_bucket_size": elems,
        },
    }  # fmt: skip
    # DeepSpeed 0.19's Init._set_dtype reads `dtype or fp16 if fp16_supported else bf16 ...`:
    # on a CPU without fp16 it casts the parameters to bf16 whatever dtype it is given. Saying
    # fp16 is supported while the model is built and initialize() runs keeps the fp32 it is passed.
    import torch
    from deepspeed.accelerator import get_accelerator
    from transformers import GPT2LMHeadModel
    from transformers.integrations import HfDeepSpeedConfig

    accel = get_accelerator()
    original = accel.is_fp16_supported
    accel.is_fp16_supported = lambda: True
    # transformers' documented ZeRO-3 model creation: with an HfDeepSpeedConfig alive, building
    # from a config runs under deepspeed.zero.Init (each module partitioned as it is made, its
    # weights initialised gathered), so the model is never whole in memory
    # (``whole``: the model built whole in memory first, DeepSpeed's other way; the bench keeps
    # whichever fits the larger model, then the faster)
    zero3 = None if whole else HfDeepSpeedConfig(config)  # noqa: F841 (transformers keeps a weak reference)
    try:
        torch.manual_seed(0)
        model = GPT2LMHeadModel._from_config(model_config, torch_dtype=torch.float32)
        if cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    finally:
        accel.is_fp16_supported = original

    def step(tokens):
        loss = causal_lm_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
        return float(loss)

    return step, lambda: None, "nvme" if nvme else "cpu"


def build_deepspeed_ops(progress: bool) -> None:
    """DeepSpeed compiles its CPU ops (CPU Adam, the shared-memory collectives) on first use:
    built once here, outside any trial, so no trial's budget or time pays for a compiler (a
    build killed by the hard limit also leaves a lock every later trial waits on)."""
    folder = os.path.abspath(os.environ.get("TORCH_EXTENSIONS_DIR", ".cache/torch_extensions"))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": folder}
    code = (
        "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder\n"
        "CPUAdamBuilder().load(); ShareMemCommBuilder().load()"
    )
    began = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    if progress:
        state = (
            "ready" if out.returncode == 0 else "FAILED: " + (out.stderr.strip().splitlines() or ["?"])[-1]
        )
        print(
            f"offload bench: DeepSpeed CPU ops {state} ({time.perf_counter() - began:.0f} s)", file=sys.stderr
        )
