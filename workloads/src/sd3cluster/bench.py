"""Training-step throughput of SD3 variants on one device: images/s, MFU against a stated peak, peak memory.

Every variant runs `sd3cluster train`'s own step (train.Trainer: its data path with read-ahead, its noise, its
parallelism and optimizer), so the benchmark measures the code users run. A variant is the run's configuration
with overrides: `name` or `name:key=value,...` over the short keys of VARIANT_KEYS, for example
`optimized:attn=cudnn,batch=16`. `optimized` is the configuration as given (train's defaults); `reference` is the
loop of diffusers' SD3 training script: no fused q/k/v, eager blocks, PyTorch's attention dispatch, AdamW
(foreach). MFU counts the FLOPs of the unmodified diffusers model (models.train_flops_per_image) for all of them.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .config import Config
from .dist import Runtime
from .errors import UserError
from .models import train_flops_per_image

# Short variant keys -> the configuration key each one sets.
VARIANT_KEYS: dict[str, str] = {
    "fuse": "model.fuse_qkv", "compile": "model.compile", "attn": "model.attention", "adam": "optim.fused",
    "ac": "model.activation_checkpointing", "fsdp": "train.parallel", "batch": "data.batch_size",
    "res": "data.resolution", "fp8": "model.float8", "mlp": "model.mlp", "proj": "model.projections",
    "norm": "model.norm", "opt": "optim.kernel", "w": "train.weights", "layout": "model.layout",
}


def _as_named(*names: str) -> dict[str, str]:
    return {name: name for name in names}


# The values a short key takes, and the configuration value each stands for.
VARIANT_VALUES: dict[str, dict[str, Any]] = {
    "fuse": {"0": False, "1": True}, "compile": {"none": False, "block": True},
    "attn": _as_named("auto", "fa4", "cudnn", "flash", "sdpa"),
    "adam": {"foreach": False, "fused": True}, "ac": {"0": False, "1": True}, "fsdp": {"0": "ddp", "1": "fsdp"},
    "fp8": _as_named("none", "tensorwise", "rowwise", "rowwise_with_gw_hp"),
    "mlp": _as_named("auto", "torch", "quack"), "proj": _as_named("auto", "torch", "quack"),
    "norm": _as_named("auto", "torch", "triton"),
    "opt": _as_named("auto", "torch", "triton"), "w": _as_named("auto", "fp32", "bf16"),
    "layout": _as_named("auto", "batch", "sequence"),
}
VARIANT_DEFAULTS: dict[str, dict[str, str]] = {
    "reference": dict(fuse="0", compile="none", attn="sdpa", adam="foreach", mlp="torch", proj="torch",
                      norm="torch", opt="torch", w="fp32", layout="batch"),
    "optimized": {},
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


@dataclass
class Variant:
    name: str
    overrides: dict[str, Any]

    @classmethod
    def parse(cls, spec: str) -> Variant:
        name, _, rest = spec.partition(":")
        where = f"bench.variants (--variants) entry {spec!r}"
        if name not in VARIANT_DEFAULTS:
            raise BenchVariantError(f"{where}: unknown bench variant {name!r}; choose from "
                                    f"{', '.join(VARIANT_DEFAULTS)}")
        options = dict(VARIANT_DEFAULTS[name])
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key not in VARIANT_KEYS:
                raise BenchVariantError(f"{where}: unknown option {key!r}; the options are "
                                        f"{', '.join(sorted(VARIANT_KEYS))}")
            if key in VARIANT_VALUES and value not in VARIANT_VALUES[key]:
                raise BenchVariantError(f"{where}: {key}={value!r}; choose one of {', '.join(VARIANT_VALUES[key])}")
            if key not in VARIANT_VALUES and not (value.isdigit() and int(value) >= 1):
                raise BenchVariantError(f"{where}: {key}={value!r} must be a whole number of 1 or more")
            options[key] = value
        overrides = {VARIANT_KEYS[k]: VARIANT_VALUES[k][v] if k in VARIANT_VALUES else int(v)
                     for k, v in options.items()}
        return cls(spec, overrides)

    def config(self, base: Config, extra: dict[str, Any] | None = None) -> Config:
        """`base` with this variant's overrides (and `extra` ones), validated as any configuration is."""
        tree = json.loads(base.model_dump_json())
        for key, value in {**self.overrides, **(extra or {})}.items():
            section, _, leaf = key.partition(".")
            tree[section][leaf] = value
        return Config.model_validate(tree)


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
    peak_gib: float  # the warm steps' peak: the steady state a run holds (NaN off CUDA)
    loss: float
    compile_s: float
    # the first step's peak: compilation and kernel autotuning (quack tunes its GEMMs there on a machine without
    # its cache) may hold more than a warm step, so a variant's memory is compared by peak_gib
    first_step_peak_gib: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)


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


COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")


def copy_ops(prof: Any) -> list[dict[str, Any]]:
    """The copy ops of a trace recorded with CPU activity and shapes, by input shape, largest device time first:
    a same-dtype copy outside Inductor's kernels (`.contiguous()`, `clone`, `copy_` of a custom op's input or of a
    gradient between compiled blocks) is an anonymous `elementwise_kernel` in the kernel list; its shape tells a
    stream-sized copy from a small per-sample one (how run 14 found the block-edge copies)."""
    rows = [{"op": e.key, "calls": e.count, "device_ms": round(e.device_time_total / 1e3, 3),
             "shapes": str(e.input_shapes)}
            for e in prof.key_averages(group_by_input_shape=True) if e.key in COPY_OPS]
    return sorted(rows, key=lambda row: (-row["device_ms"], -row["calls"]))


def _init_single_process_group(device: torch.device) -> None:
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def run_variant(variant: Variant, base: Config, device: torch.device, profile_steps: int = 0,
                trace_copies: bool = False) -> BenchResult:
    """bench.warmup steps (the first one timed apart: compilation), then bench.steps timed steps of train's own
    Trainer on synthetic samples, in one process; the host never waits for the device inside the timed steps.
    profile_steps: trace that many more steps' kernels; trace_copies: one more step with the CPU ops and shapes
    recorded, for its copy ops (copy_ops; apart from the kernel trace, whose kernel times it would count twice)."""
    from torch.profiler import ProfilerActivity, profile

    from .train import Trainer

    cfg = variant.config(base)
    steps, warmup = cfg.bench.steps, cfg.bench.warmup
    batch, resolution = cfg.data.batch_size, cfg.data.resolution
    cfg = variant.config(base, {"data.synthetic_samples": batch * (warmup + steps + profile_steps + trace_copies + 2),
                                "data.path": None, "checkpoint.dir": None})
    fsdp = cfg.train.parallel == "fsdp"
    if fsdp:
        _init_single_process_group(device)
    rt = Runtime(rank=0, world=1, local_rank=0, device=device, distributed=fsdp)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    peak_gib = (lambda: torch.cuda.max_memory_allocated(device) / 2**30) if cuda else (lambda: float("nan"))
    trainer = Trainer(cfg, rt)
    try:
        t0 = time.perf_counter()
        float(trainer.step_async()["loss"])
        compile_s = time.perf_counter() - t0
        first_peak = peak_gib()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(warmup - 1):
            trainer.step_async()
        sync()
        t0 = time.perf_counter()
        losses = [trainer.step_async()["loss"] for _ in range(steps)]
        sync()
        step_s = (time.perf_counter() - t0) / steps
        loss = float(torch.stack(losses).float().mean())
        if not math.isfinite(loss):
            raise RuntimeError(f"variant {variant.name}: loss is {loss}")
        extra: dict[str, Any] = {"kernels": trainer.kernel_note}
        if profile_steps and cuda:
            # Steady state only: the model is compiled and warm, so no autotuning or compilation is in the trace.
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(profile_steps):
                    trainer.step_async()
                sync()
            extra["kernel_ms_per_step"] = kernel_breakdown(prof, profile_steps)
            extra["top_kernels"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60,
                                                             max_name_column_width=90)
        if trace_copies:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities, record_shapes=True) as prof:
                trainer.step_async()
                sync()
            extra["copy_ops"] = copy_ops(prof)
        peak = peak_gib()
        params = trainer.parameters_count
    finally:
        trainer.close()
        if fsdp:
            import torch.distributed as dist

            dist.destroy_process_group()
    images_per_s = batch / step_s
    flops = train_flops_per_image(cfg.model.preset, resolution, cfg.data.text_tokens)
    mfu = flops * images_per_s / (cfg.train.peak_tflops * 1e12)
    return BenchResult(variant.name, cfg.model.preset, resolution, batch, params, step_s, images_per_s, mfu, peak, loss,
                       compile_s, first_step_peak_gib=first_peak, extra=extra)

def format_table(results: list[BenchResult], reference: str = "reference") -> str:
    ref = {(r.preset, r.resolution): r for r in results if r.variant == reference}
    head = ("| variant | preset | res | batch | step s | images/s | MFU | vs reference | peak GiB | loss "
            "| first step s | first step's peak GiB |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in results:
        base = ref.get((r.preset, r.resolution))
        ratio = f"{r.images_per_s / base.images_per_s:.2f}x" if base else "-"
        lines.append(f"| {r.variant} | {r.preset} | {r.resolution} | {r.batch} | {r.step_s:.3f} | "
                     f"{r.images_per_s:.2f} | {r.mfu:.3f} | {ratio} | {r.peak_gib:.1f} | {r.loss:.4f} | "
                     f"{r.compile_s:.1f} | {r.first_step_peak_gib:.1f} |")
    return "\n".join(lines)


def run_bench(cfg: Config, device: torch.device | None = None) -> list[BenchResult]:
    """`sd3cluster bench`: the configured variants of this configuration, one after the other in this process."""
    from .dist import pick_device

    device = device or pick_device(cfg.train.device)
    results = []
    for spec in cfg.bench.variants:
        res = run_variant(Variant.parse(spec), cfg, device)
        results.append(res)
        print(f"[bench] {res.variant}: {res.images_per_s:.2f} images/s, MFU {res.mfu:.3f} "
              f"(peak {cfg.train.peak_tflops:g} TFLOP/s), {res.peak_gib:.1f} GiB; {res.extra['kernels']}", flush=True)
    print(format_table(results))
    if cfg.bench.report is not None:
        cfg.bench.report.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results
