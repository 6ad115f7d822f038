"""Training-step throughput of SD3 variants on one device: images/s, MFU against a stated peak, peak memory.

A variant is `name` or `name:key=value,...` over the keys of VARIANT_DEFAULTS, for example
`optimized:attn=flash,batch=16`. `reference` is the loop of diffusers' SD3 training script: fp32 weights, bf16
autocast, eager model, AdamW (foreach). Every variant runs the same rectified-flow step on the same shapes, and
MFU counts the FLOPs of the unmodified diffusers model (torch.utils.flop_counter, forward x 3) for all of them.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .config import Config, FlowConfig, OptimConfig
from .errors import UserError
from .flow import flow_loss, shift_sigmas
from .models import build_transformer, convert_to_float8, count_parameters, example_inputs, forward_flops, fuse_qkv
from .optim import MasterWeightAdamW, make_adamw

VARIANT_DEFAULTS: dict[str, dict[str, Any]] = {
    "reference": dict(fuse=0, compile="none", attn="default", weights="fp32", adam="foreach", ac=0, fsdp=0),
    "reference-compile": dict(fuse=0, compile="model", attn="default", weights="fp32", adam="fused", ac=0, fsdp=0),
    "optimized": dict(fuse=1, compile="block", attn="cudnn", weights="bf16", adam="fused", ac=0, fsdp=0,
                      fp8="none"),
}

# Kernel families of a training step, by CUDA kernel name (first match wins).
KERNEL_FAMILIES: list[tuple[str, str]] = [
    ("attention", r"cudnn|fmha|flash|attn|sdpa"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|_mm_|splitk|scaled_mm"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("triton (fused elementwise/norm)", r"triton"),
]


class BenchVariantError(UserError, ValueError):
    """A `bench.variants` entry names an unknown variant, option or option value."""


# The values an option may take (a whole number for batch, res, fuse, ac and fsdp).
VARIANT_CHOICES: dict[str, tuple[str, ...]] = {
    "compile": ("none", "model", "block"), "attn": ("default", "flash", "cudnn", "efficient", "math"),
    "weights": ("fp32", "bf16"), "adam": ("foreach", "fused"),
    "fp8": ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp"),
    "mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
}
_WHOLE_NUMBER_OPTIONS = ("fuse", "ac", "fsdp", "batch", "res")


@dataclass
class Variant:
    name: str
    options: dict[str, Any]

    @classmethod
    def parse(cls, spec: str) -> Variant:
        name, _, rest = spec.partition(":")
        base = name.split("+")[0]
        where = f"bench.variants (--variants) entry {spec!r}"
        if base not in VARIANT_DEFAULTS:
            raise BenchVariantError(f"{where}: unknown bench variant {base!r}; choose from "
                                    f"{', '.join(VARIANT_DEFAULTS)}")
        options = dict(VARIANT_DEFAULTS[base])
        known = sorted({*options, *VARIANT_CHOICES, *_WHOLE_NUMBER_OPTIONS})
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key not in known:
                raise BenchVariantError(f"{where}: unknown option {key!r}; the options are {', '.join(known)}")
            if key in _WHOLE_NUMBER_OPTIONS:
                if not value.isdigit() or (key in ("batch", "res") and int(value) < 1):
                    raise BenchVariantError(f"{where}: {key}={value!r} must be a whole number"
                                            + (" of 1 or more" if key in ("batch", "res") else " (0 or 1)"))
            elif value not in VARIANT_CHOICES[key]:
                raise BenchVariantError(f"{where}: {key}={value!r}; choose one of {', '.join(VARIANT_CHOICES[key])}")
            options[key] = int(value) if value.lstrip("-").isdigit() else value
        return cls(spec, options)


@dataclass
class BenchResult:
    variant: str
    preset: str
    resolution: int
    batch: int
    parameters: int
    step_s: float
    images_per_s: float
    mfu: float
    peak_gib: float
    loss: float
    compile_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def _attention_context(attn: str) -> contextlib.AbstractContextManager:
    if attn == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([backends[attn]])


def kernel_breakdown(prof: Any, steps: int) -> dict[str, float]:
    """Milliseconds of GPU time per step in each kernel family (KERNEL_FAMILIES, the rest as "other")."""
    import re

    totals: dict[str, float] = {name: 0.0 for name, _ in KERNEL_FAMILIES}
    totals["other"] = 0.0
    for event in prof.key_averages():
        device_us = event.self_device_time_total  # kernels' own time: nothing counted twice
        if not device_us:
            continue
        family = next((name for name, pattern in KERNEL_FAMILIES if re.search(pattern, event.key, re.I)), "other")
        totals[family] += device_us / 1e3 / steps
    return {k: round(v, 2) for k, v in totals.items()}


def _init_single_process_group(device: torch.device) -> None:
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def run_variant(variant: Variant, preset: str, resolution: int, batch: int, text_tokens: int, steps: int,
                warmup: int, device: torch.device, flops_per_image: float, peak_tflops: float,
                flow: FlowConfig | None = None, optim: OptimConfig | None = None,
                profile_steps: int = 0) -> BenchResult:
    o = variant.options
    batch = int(o.get("batch", batch))
    resolution = int(o.get("res", resolution))
    flow = flow or FlowConfig()
    optim = optim or OptimConfig(fused=o["adam"] == "fused")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_transformer(preset, device=device)
    params = count_parameters(model)
    if o["fuse"]:
        fuse_qkv(model, attention_backend=o["attn"])
    if o.get("fp8", "none") != "none":
        convert_to_float8(model, o["fp8"])
    bf16_weights = o["weights"] == "bf16"
    if o["fsdp"]:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        _init_single_process_group(device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.transformer_blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        optimizer: Any = make_adamw(list(model.parameters()), optim, device)
    elif bf16_weights:
        model.to(dtype=torch.bfloat16)
        optimizer = MasterWeightAdamW(model, optim, device)
    else:
        optimizer = make_adamw(list(model.parameters()), optim, device)
    if o["ac"]:
        model.enable_gradient_checkpointing()
    if o["compile"] == "model":
        model = torch.compile(model, mode=None if o.get("mode", "default") == "default" else o["mode"])
    elif o["compile"] == "block":
        from torch import _dynamo

        limit = _dynamo.config.recompile_limit
        _dynamo.config.recompile_limit = max(limit, len(model.transformer_blocks) + 8)
        for block in model.transformer_blocks:
            block.compile(mode=None if o.get("mode", "default") == "default" else o["mode"])
    model.train()
    # bf16 weights, or FSDP2's bf16 compute copies of fp32 masters: inputs in bf16 and no autocast.
    low_precision = bf16_weights or bool(o["fsdp"])
    dtype = torch.bfloat16 if low_precision else torch.float32
    inputs = example_inputs(preset, batch, resolution, text_tokens, device, dtype)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not low_precision)
    gen = torch.Generator(device=device).manual_seed(0)

    def step() -> torch.Tensor:
        noise = torch.randn(inputs["hidden_states"].shape, device=device, dtype=dtype, generator=gen)
        u = torch.sigmoid(torch.randn(batch, device=device, generator=gen))
        sigmas = shift_sigmas(u, flow.shift).to(dtype)
        with autocast, _attention_context(o["attn"]):
            loss = flow_loss(model, flow, inputs["hidden_states"], inputs["encoder_hidden_states"],
                             inputs["pooled_projections"], noise, sigmas)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    step()
    sync()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    sync()
    t0 = time.perf_counter()
    losses = [step() for _ in range(steps)]
    sync()
    step_s = (time.perf_counter() - t0) / steps
    loss = float(torch.stack(losses).float().mean())
    if not math.isfinite(loss):
        raise RuntimeError(f"variant {variant.name}: loss is {loss}")
    images_per_s = batch / step_s
    mfu = flops_per_image * images_per_s / (peak_tflops * 1e12)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    extra: dict[str, Any] = {}
    if profile_steps and device.type == "cuda":
        # Steady state only: the model is compiled and warm, so no autotuning or compilation is in the trace.
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(profile_steps):
                step()
            sync()
        extra["kernel_ms_per_step"] = kernel_breakdown(prof, profile_steps)
        extra["top_kernels"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                                         max_name_column_width=90)
    if o["fsdp"]:
        import torch.distributed as dist

        dist.destroy_process_group()
    return BenchResult(variant.name, preset, resolution, batch, params, step_s, images_per_s, mfu, peak, loss,
                       compile_s, extra)


def train_flops_per_image(preset: str, resolution: int, text_tokens: int) -> float:
    """Forward FLOPs of one image x 3 (forward + backward), as the issue defines MFU."""
    return 3.0 * forward_flops(preset, 1, resolution, text_tokens)


def format_table(results: list[BenchResult], reference: str = "reference") -> str:
    ref = {(r.preset, r.resolution): r for r in results if r.variant == reference}
    head = ("| variant | preset | res | batch | step s | images/s | MFU | vs reference | peak GiB | loss "
            "| first step s |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in results:
        base = ref.get((r.preset, r.resolution))
        ratio = f"{r.images_per_s / base.images_per_s:.2f}x" if base else "-"
        lines.append(f"| {r.variant} | {r.preset} | {r.resolution} | {r.batch} | {r.step_s:.3f} | "
                     f"{r.images_per_s:.2f} | {r.mfu:.3f} | {ratio} | {r.peak_gib:.1f} | {r.loss:.4f} | "
                     f"{r.compile_s:.1f} |")
    return "\n".join(lines)


def run_bench(cfg: Config, device: torch.device | None = None) -> list[BenchResult]:
    """`sd3cluster bench`: the configured variants on the configured preset, shapes and batch."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    flops = train_flops_per_image(cfg.model.preset, cfg.data.resolution, cfg.data.text_tokens)
    results = []
    for spec in cfg.bench.variants:
        variant = Variant.parse(spec)
        if device.type != "cuda" and variant.options["adam"] == "fused":
            variant.options["adam"] = "foreach"
        if device.type != "cuda" and variant.options["attn"] != "default":
            variant.options["attn"] = "default"
        if device.type != "cuda" and variant.options["compile"] != "none":
            variant.options["compile"] = "none"
        res = run_variant(variant, cfg.model.preset, cfg.data.resolution, cfg.data.batch_size, cfg.data.text_tokens,
                          cfg.bench.steps, cfg.bench.warmup, device, flops, cfg.train.peak_tflops, cfg.flow)
        results.append(res)
        print(f"[bench] {res.variant}: {res.images_per_s:.2f} images/s, MFU {res.mfu:.3f} "
              f"(peak {cfg.train.peak_tflops:g} TFLOP/s), {res.peak_gib:.1f} GiB", flush=True)
    print(format_table(results))
    if cfg.bench.report is not None:
        cfg.bench.report.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results
