"""One typed configuration for every sd3cluster command: read from YAML, overridden by `--set key=value`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import UserError


class ConfigError(UserError):
    """A configuration value is wrong; the message names the key and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    preset: Literal["tiny", "sd3-medium", "sd35-medium", "sd35-large"] = "tiny"
    pretrained: Path | None = Field(None, description="local diffusers folder (transformer/ or the model itself)")
    fuse_qkv: bool = Field(True, description="one projection for q, k and v (and for the context's)")
    compile: bool = Field(True, description="torch.compile every transformer block and the image stream's ends "
                          "outside them (patch embedding, final norm; CUDA only; the first step compiles, about 20 s "
                          "for SD3-medium)")
    attention: Literal["auto", "fa4", "cudnn", "flash", "sdpa"] = Field(
        "auto", description="attention kernel of the fused q/k/v model: fa4 (FlashAttention-4, sm90+, `pip install "
        "'sd3cluster[fa4]'`), cudnn, flash (PyTorch's FlashAttention-2), sdpa (PyTorch's dispatch); auto: fa4 on "
        "sm90+ when it imports, else cudnn on CUDA, else sdpa. Printed at start")
    float8: Literal["none", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = Field(
        "none", description="float8 GEMMs for the joint blocks' linears (torchao, sm89+, with model.compile); "
        "measured no faster than bf16 for SD3-medium on an H200 (benchmarks/sd3_training.md)")
    mlp: Literal["auto", "torch", "quack"] = Field(
        "auto", description="feed-forward kernels: torch (nn.Linear, GELU, nn.Linear, compiled with the block) or "
        "quack (the GELU and its gradient in the GEMMs' epilogues: a 2.5% faster step and 9 GiB less memory for "
        "SD3-medium on an H200; sm90+, comes with the `fa4` extra; it tunes its GEMMs in the first step, about 2 "
        "minutes, cached on disk); auto: quack on sm90+ when it imports, for bf16 full training, else torch. Printed "
        "at start")
    norm: Literal["auto", "torch", "triton"] = Field(
        "auto", description="adaLN LayerNorm + modulation (and the gated residuals before the second norm and after "
        "the feed-forward, with the output projections' biases) of the "
        "joint blocks: torch (diffusers' modules, compiled with the block) or triton (one fused kernel each way, "
        "sd3cluster.fused_norm); auto: triton on CUDA when it imports, else torch. Printed at start")
    layout: Literal["auto", "batch", "sequence"] = Field(
        "auto", description="memory layout of the joint blocks' streams: sequence ((tokens, batch, channels): both "
        "streams' q/k/v are row blocks of one packed tensor, which FA4 reads and writes in place, so no q/k/v is "
        "copied or stacked) or batch (diffusers' (batch, tokens, channels)); auto: sequence where it applies "
        "(fused q/k/v without q/k norms, model.attention resolved to fa4, model.norm to triton). Printed at start")
    projections: Literal["auto", "torch", "quack"] = Field(
        "auto", description="GEMM kernels of the sequence-first joint blocks' attention projections (q/k/v and "
        "output, forward and backward): torch (cuBLAS) or quack (for the image stream's rows; the context stream's "
        "few rows, and weight gradients too small to fill the card, stay on cuBLAS, which is faster there; 5.5 to 8% "
        "faster GEMMs for SD3-medium's image stream and a 1.2% faster step on an H100; sm90+, comes with the `fa4` "
        "extra, tuned in the first step like model.mlp's); auto: quack on sm90+ when it imports, for bf16 training in "
        "the sequence layout without LoRA or float8 linears, else torch. Printed at start")
    activation_checkpointing: bool = False


class DataConfig(_Section):
    path: Path | None = Field(None, description="folder of shards written by `sd3cluster prepare`")
    synthetic_samples: int = Field(0, ge=0, description="use this many synthetic samples instead of `path`")
    resolution: int = Field(64, ge=16, description="image side in pixels (latents are 1/8 of it)")
    text_tokens: int = Field(154, ge=1, description="text sequence length (77 CLIP + 77 T5 in SD3)")
    batch_size: int = Field(2, ge=1, description="samples per rank per micro-step")
    seed: int = 0

    @model_validator(mode="after")
    def _resolution_multiple(self) -> DataConfig:
        if self.resolution % 16:
            raise ValueError(f"resolution must be a multiple of 16 (VAE factor 8 x patch 2), got {self.resolution}")
        return self


class FlowConfig(_Section):
    weighting_scheme: Literal["logit_normal", "mode", "uniform", "sigma_sqrt", "cosmap"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = Field(1.0, gt=0)
    mode_scale: float = 1.29
    shift: float = Field(3.0, gt=0, description="timestep shift of SD3's flow-matching scheduler")
    precondition_outputs: bool = True


class OptimConfig(_Section):
    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(1e-4, ge=0)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="max gradient norm; 0 turns clipping off")
    fused: bool = Field(True, description="fused AdamW where the device supports it")
    kernel: Literal["auto", "torch", "triton"] = Field(
        "auto", description="what steps AdamW (optim.optimizer=adamw, optim.fused=true): triton (two Triton launches "
        "over every parameter, the gradient norm and clip inside them; fp32 parameters on CUDA, not FSDP), torch "
        "(torch's fused AdamW after clip_grad_norm_); auto takes triton where it can. Checkpoints are the same")
    optimizer: Literal["adamw", "adamw8bit", "paged_adamw8bit", "paged_adamw", "ao_adamw8bit"] = Field(
        "adamw", description="adamw (torch); adamw8bit, paged_adamw8bit, paged_adamw: bitsandbytes' (CUDA only, "
        "`pip install bitsandbytes`; 8-bit state is 2 bytes a parameter instead of 8, paged state moves to the host "
        "under memory pressure); ao_adamw8bit: torchao's 8-bit AdamW (`pip install torchao`, also on CPU)")


class TrainConfig(_Section):
    steps: int = Field(100, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    grad_accum: int = Field(1, ge=1)
    parallel: Literal["ddp", "fsdp"] = "ddp"
    mode: Literal["full", "lora"] = Field("full", description="full: every weight trains; lora: the base is frozen "
                                         "and only LoRA adapters (section lora:) and their optimizer state train "
                                         "and go into checkpoints")
    fsdp_cpu_offload: bool = Field(False, description="FSDP2 keeps sharded parameters, gradients and optimizer "
                                   "state in host memory and steps the optimizer on the CPU (train.parallel=fsdp)")
    ordered_reduce: bool = Field(False, description="DDP sums gradients in rank order (all-gather): bit-exact "
                                 "runs on 3+ ranks, at the cost of bandwidth; verify turns it on for CPU")
    precision: Literal["bf16", "fp32"] = "bf16"
    weights: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="dtype of the trained weights and their gradients with bf16 compute: bf16 (fp32 masters "
        "in the Triton AdamW, which writes the bf16 copy as it updates; DDP sums the gradients in fp32) or fp32 "
        "(autocast casts every weight at every use and its gradient back); auto takes bf16 with optim.kernel=triton, "
        "full training and train.grad_accum=1. Checkpoints hold the fp32 masters, as an fp32 run's")
    ema_decay: float = Field(0.0, ge=0, lt=1, description="0 turns EMA off")
    seed: int = 0
    log_every: int = Field(1, ge=1)
    peak_tflops: float = Field(989.0, gt=0, description="dense bf16 peak per device, for MFU (H100/H200 SXM)")
    kill_at_step: int = Field(0, ge=0, description="test hook: rank `kill_rank` SIGKILLs itself there, first try only")
    kill_rank: int = Field(0, ge=0)


# The linear layers of a joint block that LoRA can adapt, in diffusers' names (attn2: SD3.5's second attention).
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear",
                "norm1_context.linear")
LORA_DEFAULT_TARGETS = [t for t in LORA_TARGETS if not t.startswith("norm1")]


class LoraSection(_Section):
    """LoRA adapters (train.mode=lora), through peft: W x + (alpha / rank) B A x, with B starting at zero."""

    rank: int = Field(16, ge=1, le=1024, description="rank r of each adapter")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is (alpha / rank) B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (training only)")
    target_modules: list[str] = Field(LORA_DEFAULT_TARGETS, description="linear layers of every joint block to "
                                      "adapt, in diffusers' names; default: attention and MLP projections")
    group_lr: dict[str, float] = Field({}, description="learning rate per group of targets: a key is a target or a "
                                       "prefix of targets (attn, ff, ff_context, attn.to_out); the longest matching "
                                       "key wins; targets no key matches train at optim.lr")
    base_dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="dtype of the frozen base weights; auto: "
                                                        "bf16 on GPU with train.precision=bf16, else fp32")

    @model_validator(mode="after")
    def _known_targets(self) -> LoraSection:
        if not self.target_modules:
            raise ValueError("target_modules is empty; name at least one layer (" + ", ".join(LORA_TARGETS) + ")")
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"unknown target module(s) {', '.join(unknown)}; choose from {', '.join(LORA_TARGETS)}")
        for key, lr in self.group_lr.items():
            if not any(t == key or t.startswith(key + ".") for t in self.target_modules):
                raise ValueError(f"group_lr key {key!r} matches none of target_modules; use a target or a prefix of "
                                 "one (attn, ff, ff_context, attn.to_out)")
            if not lr > 0:
                raise ValueError(f"group_lr[{key!r}] must be > 0, got {lr}")
        return self


class CheckpointConfig(_Section):
    dir: Path | None = Field(None, description="checkpoint folder on the shared volume; none: no checkpoints")
    every: int = Field(50, ge=1)
    keep: int = Field(3, ge=1)
    resume: Literal["auto", "never"] | Path = "auto"


class OutputConfig(_Section):
    dir: Path = Path("runs/sd3")
    tensorboard: bool = True
    progress: bool = True


class VerifyConfig(_Section):
    steps: int = Field(3, ge=1, description="N steps for the identical-parameters and DDP-equality checks")
    resume_k: int = Field(2, ge=1, description="k of the resume check: 2k straight vs k + resume + k")
    overfit_steps: int = Field(30, ge=2)
    overfit_lr: float = Field(5e-3, gt=0, description="learning rate of the overfit check (lower it for big presets)")
    overfit_ratio: float = Field(0.5, gt=0, description="pass when last loss / first loss is below this")
    allreduce_sizes_mb: list[float] = [0.25, 4.0, 32.0]
    # Thresholds come from the hardware profiles (sd3cluster/hardware_profiles.yaml): expected x fraction.
    gpu_profile: str = Field("auto", description="GPU profile, or auto (from the device name) or none (no GPU "
                             "thresholds); an unknown GPU must be named here")
    network_profile: str | None = Field(None, description="network profile of the NICs between nodes (eth-100g, "
                                        "ib-ndr, efa, ...); none: the inter-node all-reduce has no threshold")
    nics_per_node: int = Field(1, ge=1, description="NICs per node that carry NCCL traffic (the network profile is "
                               "per NIC)")
    intra_node_link: str | None = Field(None, description="link between a node's GPUs (nvlink4, pcie5, ...); "
                                        "none: the GPU profile's")
    threshold_fraction: float = Field(0.8, gt=0, le=1, description="threshold = expected x this")
    # Explicit thresholds replace the profile's; 0 is refused (it would pass anything).
    min_gemm_tflops: float | None = Field(None, gt=0)
    min_memory_gb_s: float | None = Field(None, gt=0)
    min_busbw_gbps: float | None = Field(None, gt=0, description="all-reduce bus bandwidth, GB/s, intra and inter node")
    min_gpu_images_per_s: float | None = Field(None, gt=0, description="the per-GPU training check (verify preset)")
    min_images_per_s: float | None = Field(None, gt=0, description="throughput of the correctness run (this config)")
    gemm_size: int = Field(8192, ge=256, description="side of the square bf16 matrices of the GEMM check")
    memory_mb: int = Field(2048, ge=16, description="size of the buffer the memory-bandwidth check copies")
    gpu_training: bool = Field(True, description="run the per-GPU training check (verify preset) on GPUs")
    tolerance: float = Field(1e-4, gt=0, description="max abs parameter difference for DDP == one process")
    report: Path = Path("verify-report.json")


class PrepareConfig(_Section):
    images: Path | None = Field(None, description="folder of images, each with a caption file NAME.txt beside it")
    encoders: Path | None = Field(None, description="local SD3 folder: vae/, text_encoder{,_2,_3}/, tokenizer{,_2,_3}/")
    out: Path | None = Field(None, description="folder the shards and index.json are written to")
    shard_size: int = Field(256, ge=1)
    batch_size: int = Field(8, ge=1)
    clip_tokens: int = Field(77, ge=1)
    t5_tokens: int = Field(77, ge=1)
    synthetic: int = Field(0, ge=0, description="write this many synthetic samples instead (model.preset's shapes)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    buckets: bool = Field(False, description="sort images into aspect-ratio buckets of about data.resolution^2 "
                          "pixels (sides multiples of bucket_step) instead of square center crops")
    bucket_step: int = Field(64, ge=16, description="bucket sides are multiples of this (16 at least: VAE 8 x patch 2)")
    max_aspect: float = Field(4.0, ge=1, le=16, description="widest bucket's width/height (and tallest's inverse)")
    progress_every_s: float = Field(10.0, gt=0, description="seconds between rank 0's progress lines")
    kill_after_shards: int = Field(0, ge=0, description="test hook: rank `kill_rank` SIGKILLs itself after writing "
                                   "this many shards, first try only")
    kill_rank: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _step_multiple(self) -> PrepareConfig:
        if self.bucket_step % 16:
            raise ValueError(f"bucket_step must be a multiple of 16 (VAE factor 8 x patch 2), got {self.bucket_step}")
        return self


class PreviewConfig(_Section):
    """Images rendered from the current weights while training, so users see what the model learns."""

    every: int = Field(0, ge=0, description="render the prompts every N optimizer steps; 0 turns previews off")
    prompts: list[str] = Field(["a photo of a cat", "a red house in the snow"], description="fixed prompt set")
    steps: int = Field(20, ge=1, description="sampling steps per preview image")
    guidance: float = Field(5.0, ge=0, description="classifier-free guidance scale (1 or less: no guidance)")
    seed: int = 0
    encoders: Path | None = Field(None, description="local SD3 folder with VAE and text encoders; default "
                                  "model.pretrained, else random encoders of the preset (tests)")


class ExportConfig(_Section):
    checkpoint: Path | None = Field(None, description="checkpoint folder of a run (checkpoint.dir) or one step-* of it")
    step: int | Literal["latest"] = Field("latest", description="which complete checkpoint of that folder")
    out: Path | None = Field(None, description="diffusers folder to write (must not exist or be empty)")
    base: Path | None = Field(None, description="local diffusers SD3 folder: copy its scheduler, VAE, text "
                              "encoders and tokenizers beside the transformer (a whole pipeline folder)")
    link: bool = Field(False, description="symlink the base's parts instead of copying them")
    dtype: Literal["bf16", "fp32"] = "bf16"
    ema: bool = Field(False, description="export the EMA weights (the run must have train.ema_decay > 0)")
    max_shard_size: str = Field("5GB", description="largest safetensors file (diffusers' shard size syntax)")


class GenerateConfig(_Section):
    prompts: Path | None = Field(None, description="prompt file: one prompt per line (.txt) or JSON objects "
                                 "(.jsonl: prompt, and optional negative_prompt, seed, width, height)")
    out: Path | None = Field(None, description="folder of images/ and manifest.jsonl (the shared volume)")
    pretrained: Path | None = Field(None, description="local diffusers SD3 folder (a whole pipeline)")
    checkpoint: Path | None = Field(None, description="training checkpoint (DCP) to take the transformer from")
    step: int | Literal["latest"] = "latest"
    ema: bool = Field(False, description="the checkpoint's EMA weights")
    lora: Path | None = Field(None, description="diffusers-format LoRA (a .safetensors file, or a folder holding "
                              "pytorch_lora_weights.safetensors, as `sd3cluster export` writes it) merged into the "
                              "transformer's weights")
    lora_scale: float = Field(1.0, ge=0, le=10, description="strength of the LoRA (1: as trained)")
    steps: int = Field(28, ge=1, le=1000, description="sampling steps")
    guidance: float = Field(7.0, ge=0, le=100, description="classifier-free guidance scale (1 or less: none)")
    width: int = Field(1024, ge=16, le=8192)
    height: int = Field(1024, ge=16, le=8192)
    negative_prompt: str = ""
    images_per_prompt: int = Field(1, ge=1, le=1000)
    batch_size: int = Field(4, ge=1, description="images per forward pass and rank")
    seed: int = Field(0, ge=0, description="base seed; each (prompt, image) gets its own seed from it")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool = Field(False, description="torch.compile each transformer block and the VAE decoder (GPU; "
                          "about 25 s once, then 1.24 s instead of 1.52 s per 1024^2 image on an H200)")
    cfg_parallel: bool = Field(False, description="conditional and unconditional passes on two ranks (latency)")
    max_sequence_length: int = Field(77, ge=1, le=512, description="T5 tokens (77: 154 text tokens in all)")
    progress_every_s: float = Field(10.0, gt=0, description="seconds between progress lines and progress.json")

    @model_validator(mode="after")
    def _sides_multiple(self) -> GenerateConfig:
        for name in ("width", "height"):
            if getattr(self, name) % 16:
                raise ValueError(f"{name} must be a multiple of 16 (VAE factor 8 x patch 2), got {getattr(self, name)}")
        return self


class ServeConfig(_Section):
    """`sd3cluster serve`: one process per GPU (CUDA_VISIBLE_DEVICES picks it), behind a balancer."""

    host: str = Field("127.0.0.1", description="address to listen on (the node's cluster address on a cluster)")
    port: int = Field(5000, ge=1, le=65535)
    name: str = Field("", description="worker label in logs and the /readyz answer (default: host:port)")
    pretrained: Path | None = Field(None, description="local diffusers SD3 folder (a whole pipeline)")
    checkpoint: Path | None = Field(None, description="training checkpoint (DCP) to take the transformer from")
    step: int | Literal["latest"] = "latest"
    ema: bool = Field(False, description="the checkpoint's EMA weights")
    lora: Path | None = Field(None, description="diffusers-format LoRA (a .safetensors file, or a folder holding "
                              "pytorch_lora_weights.safetensors, as `sd3cluster export` writes it) merged into the "
                              "transformer's weights")
    lora_scale: float = Field(1.0, ge=0, le=10, description="strength of the LoRA (1: as trained)")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool = Field(False, description="torch.compile each transformer block and the VAE decoder (GPU)")
    warmup: bool = Field(True, description="one generation at the default size before /readyz says ready "
                         "(with compile: the compilation happens there, not in a user's request)")
    max_sequence_length: int = Field(77, ge=1, le=512, description="T5 tokens (77: 154 text tokens in all)")
    max_batch: int = Field(4, ge=1, le=64, description="images per forward pass: requests of one size, steps and "
                           "guidance share it")
    max_wait_ms: float = Field(25.0, ge=0, le=10000, description="how long the first queued image waits for "
                               "others to share its batch")
    queue_size: int = Field(32, ge=1, description="images accepted but not yet started; more: 429 with Retry-After")
    request_timeout_s: float = Field(300.0, gt=0, description="deadline of a request from its arrival: 504 after "
                                     "it, and its work is dropped")
    drain_timeout_s: float = Field(600.0, gt=0, description="SIGTERM: at most this long to finish accepted work")
    drain_grace_s: float = Field(5.0, ge=0, description="SIGTERM: /readyz answers 503 at least this long before the "
                                 "listener closes, so balancers take the worker out first")
    job_ttl_s: float = Field(3600.0, gt=0, description="how long a finished /v1/jobs result is kept")
    job_prefix: str = Field("", max_length=200, pattern=r"^[A-Za-z0-9._-]*$",
                            description="start of every job id this worker hands out (PREFIX-<32 hex digits>), so "
                            "a balancer can send GET/DELETE /v1/jobs/{id} to the worker that holds the job; "
                            "letters, digits, '.', '_' and '-' (the inference role sets the worker's name)")
    output_dir: Path | None = Field(None, description="folder for response_format=path (the shared volume); "
                                    "unset: only b64_json")
    png_compress_level: int = Field(1, ge=0, le=9, description="zlib level of answered PNGs: 1 is several times "
                                    "faster than PNG's usual 6 for slightly larger files")
    default_steps: int = Field(28, ge=1, le=1000)
    max_steps: int = Field(100, ge=1, le=1000)
    default_guidance: float = Field(7.0, ge=0, le=100)
    max_guidance: float = Field(30.0, ge=0, le=100)
    default_size: int = Field(1024, ge=16, le=8192, description="side of a square image when the request gives none")
    min_side: int = Field(256, ge=16, le=8192)
    max_side: int = Field(2048, ge=16, le=8192)
    max_pixels: int = Field(2048 * 2048, ge=256, description="width x height at most")
    max_n: int = Field(4, ge=1, le=64, description="images per request at most")
    max_prompt_chars: int = Field(2000, ge=1)
    max_body_bytes: int = Field(65536, ge=1024)

    @model_validator(mode="after")
    def _consistent(self) -> ServeConfig:
        for name in ("default_size", "min_side", "max_side"):
            if getattr(self, name) % 16:
                raise ValueError(f"{name} must be a multiple of 16 (VAE factor 8 x patch 2), got {getattr(self, name)}")
        if not self.min_side <= self.default_size <= self.max_side:
            raise ValueError(f"default_size {self.default_size} must lie within min_side {self.min_side} and "
                             f"max_side {self.max_side}")
        if self.default_size ** 2 > self.max_pixels:
            raise ValueError(f"default_size {self.default_size}^2 exceeds max_pixels {self.max_pixels}")
        if self.default_steps > self.max_steps:
            raise ValueError(f"default_steps {self.default_steps} exceeds max_steps {self.max_steps}")
        if self.default_guidance > self.max_guidance:
            raise ValueError(f"default_guidance {self.default_guidance} exceeds max_guidance {self.max_guidance}")
        return self


class BenchConfig(_Section):
    steps: int = Field(10, ge=1)
    warmup: int = Field(3, ge=1)
    variants: list[str] = ["reference", "optimized"]
    report: Path | None = None


class Config(_Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    flow: FlowConfig = FlowConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    lora: LoraSection = LoraSection()
    checkpoint: CheckpointConfig = CheckpointConfig()
    output: OutputConfig = OutputConfig()
    verify: VerifyConfig = VerifyConfig()
    prepare: PrepareConfig = PrepareConfig()
    preview: PreviewConfig = PreviewConfig()
    export: ExportConfig = ExportConfig()
    generate: GenerateConfig = GenerateConfig()
    serve: ServeConfig = ServeConfig()
    bench: BenchConfig = BenchConfig()

    @model_validator(mode="after")
    def _modes_fit(self) -> Config:
        if self.train.mode == "lora" and self.train.parallel == "fsdp":
            raise ValueError("train.mode=lora runs with train.parallel=ddp (the frozen base is replicated, only the "
                             "adapters are reduced); FSDP2 is for full fine-tunes that do not fit one GPU")
        if self.train.fsdp_cpu_offload and self.train.parallel != "fsdp":
            raise ValueError("train.fsdp_cpu_offload needs train.parallel=fsdp")
        if self.train.mode == "lora" and self.model.fuse_qkv:
            picked = {t.rsplit(".", 1)[-1] for t in self.lora.target_modules if t.startswith("attn.")}
            for group in (("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj")):
                if 0 < len(picked & set(group)) < 3:
                    raise ValueError(f"lora.target_modules names only some of attn.{'/'.join(group)}, which "
                                     "model.fuse_qkv joins into one layer; name all three, or set "
                                     "model.fuse_qkv=false")
        return self

    def pretty(self) -> str:
        return yaml.safe_dump(json.loads(self.model_dump_json()), sort_keys=False).rstrip()


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{key}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """`train.steps=10` -> ("train.steps", 10); the value is read as YAML so numbers and lists keep their type."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like section.key=value (for example train.steps=10)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{item}' has no key before '='")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; check its spelling (`sd3cluster <cmd> --print-config` shows all keys)")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {key}: {e['msg']}{shown}")
    if len(lines) == 2:  # one problem: one line
        return f"{lines[0]} {lines[1].strip()}"
    return "\n".join(lines)


def load_config(path: Path | str | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (optional), apply dotted overrides, validate once. Raises ConfigError naming the key."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist; pass an existing YAML file to --config")
        if not path.is_file():
            raise ConfigError(f"config file {path} is a folder, not a file; pass a YAML file to --config")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} cannot be read ({e}); pass a readable YAML file to --config") \
                from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections (model:, data:, train: ...)")
        tree = loaded
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    if overrides:
        source += " + --set overrides"
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None
