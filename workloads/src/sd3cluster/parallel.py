"""Parallelism applied to the model by small functions, apart from the training loop."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .dist import Runtime
from .models import stream_ends_in_compute_dtype


def apply_activation_checkpointing(model: nn.Module) -> None:
    model.enable_gradient_checkpointing()


def apply_compile(model: nn.Module) -> None:
    """Compile each transformer block, and the image stream's two ends outside them
    (models.stream_ends_in_compute_dtype). Plain blocks share one compilation; FSDP2-wrapped ones are guarded one by
    one, so the recompile limit is raised to the block count (else dynamo falls back to eager, which breaks
    activation checkpointing's recompute)."""
    from torch import _dynamo

    tag_compile_caches()
    blocks = len(model.transformer_blocks)
    _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, blocks + 8)
    for block in model.transformer_blocks:
        block.compile()
    for module in stream_ends_in_compute_dtype(model):
        module.compile()


# The modules that define the custom ops a compiled block calls (and the graph pass fuse_norms installs).
CUSTOM_OP_MODULES = ("attention", "fused_norm", "fused_norm_pass", "quack_mlp", "row_blocks")
_TAG_PREFIX = "sd3cluster-ops-"


def tag_compile_caches() -> str:
    """Key torch.compile's on-disk caches (Inductor's graphs, AOTAutograd's) by the source of this package's custom
    ops too, through torch.compiler.config.cache_key_tag, keeping any tag of the user's. Those caches know a custom
    op by its name only: a graph planned with one version's shapes of an op's outputs (its fake implementation)
    would otherwise be handed to another version, whose op returns other shapes (an AssertionError at the first
    step after an upgrade: benchmarks/sd3_training.md run 17 met it). Returns the tag."""
    digest = hashlib.sha256()
    for name in CUSTOM_OP_MODULES:
        digest.update((Path(__file__).parent / f"{name}.py").read_bytes())
    ours = _TAG_PREFIX + digest.hexdigest()[:16]
    config = torch.compiler.config
    kept = [part for part in config.cache_key_tag.split(",") if part and not part.startswith(_TAG_PREFIX)]
    config.cache_key_tag = ",".join([*kept, ours])
    return ours


def apply_fsdp(model: nn.Module, rt: Runtime, bf16: bool, cpu_offload: bool = False) -> nn.Module:
    """FSDP2: `fully_shard` per transformer block, then the root; bf16 compute with fp32 sharded masters.
    cpu_offload: the sharded parameters, their gradients and so the optimizer state live in host memory; each
    block's parameters are copied to the GPU for its forward and backward, and the optimizer steps on the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    # Pinned host memory makes the copies asynchronous; a CPU-only run (the tests) has nothing to pin for.
    offload = CPUOffloadPolicy(pin_memory=rt.device.type == "cuda") if cpu_offload else OffloadPolicy()
    for block in model.transformer_blocks:
        fully_shard(block, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    return model


def _ordered_mean_hook(state, bucket):  # no annotations: DDP checks them at run time
    """Mean of a gradient bucket summed in rank order. A ring all-reduce over 3+ ranks adds in an order that
    depends on where a value sits in its bucket, and DDP re-buckets after its first step, so a resumed run
    (whose first step is again a first step) would differ from an uninterrupted one in the last bits."""
    buffer = bucket.buffer()
    parts = [torch.empty_like(buffer) for _ in range(dist.get_world_size())]
    future = dist.all_gather(parts, buffer, async_op=True).get_future()

    def mean(_: torch.futures.Future) -> torch.Tensor:
        total = parts[0].to(torch.float32, copy=True)  # bf16 gradients are summed in fp32 too
        for part in parts[1:]:
            total += part
        return buffer.copy_(total.div_(len(parts)))

    return future.then(mean)


def _fp32_mean_hook(state, bucket):
    """Mean of a bucket of bf16 gradients (train.weights=bf16), summed in fp32: the all-reduce would add bf16
    values in bf16, rounding at every one of its world-size steps. Sends what fp32 gradients would."""
    buffer = bucket.buffer()
    wide = buffer.float().div_(dist.get_world_size())
    future = dist.all_reduce(wide, async_op=True).get_future()

    def narrow(_: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(wide)

    return future.then(narrow)


def apply_ddp(model: nn.Module, rt: Runtime, ordered_reduce: bool = False) -> nn.Module:
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets, so nothing is copied into them
    # after backward (8 GB of fp32 gradients for SD3-medium) and the memory is not held twice.
    ddp = DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False,
                                  gradient_as_bucket_view=True)
    if ordered_reduce:
        ddp.register_comm_hook(None, _ordered_mean_hook)
    elif any(p.requires_grad and p.dtype == torch.bfloat16 for p in model.parameters()):
        ddp.register_comm_hook(None, _fp32_mean_hook)
    return ddp


def parallelize(model: nn.Module, rt: Runtime, parallel: str, compile_blocks: bool, activation_checkpointing: bool,
                bf16: bool, ordered_reduce: bool = False, fsdp_cpu_offload: bool = False) -> nn.Module:
    """Order matters: checkpointing and compile act on the blocks, then FSDP wraps them or DDP the whole."""
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile_blocks:
        apply_compile(model)
    if not rt.distributed:
        return model
    if parallel == "ddp" and rt.world == 1:
        # One rank has nothing to average, and DDP would still launch an all-reduce per 25 MB bucket beside the
        # backward. The checkpoint is the same either way (get_state_dict names parameters without "module.").
        return model
    if parallel == "fsdp":
        return apply_fsdp(model, rt, bf16, fsdp_cpu_offload)
    return apply_ddp(model, rt, ordered_reduce)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
