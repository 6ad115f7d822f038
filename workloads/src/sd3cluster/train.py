"""Rectified-flow training of SD3's transformer: the loop, its state, checkpoints and metrics."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from .attention import resolve_backend
from .buckets import BucketBatchSampler
from .checkpoint import CheckpointManager, model_differences, read_trainer_json
from .config import Config
from .data import Batch, DistributedBatchSampler, ReadAhead, ShardDataset, SyntheticDataset
from .dist import Runtime, all_reduce
from .errors import CheckpointError, DataError, UserError
from .flow import flow_loss, sample_noise
from .fused_adamw import TritonAdamW, bf16_weights_with_fp32_masters, resolve_adamw_kernel, resolve_weights
from .fused_norm import fuse_norms, resolve_norm
from .lora import apply_lora, check_checkpoint_kind
from .lora import describe as lora_describe
from .lora import param_groups as lora_param_groups
from .models import (
    build_transformer,
    convert_to_float8,
    count_parameters,
    fuse_mlp,
    fuse_qkv,
    resolve_layout,
    resolve_mlp,
    resolve_projections,
    text_dims,
    train_flops_per_image,
    transformer_description,
)
from .optim import EMA, make_optimizer, make_warmup
from .parallel import parallelize, unwrap


def open_dataset(cfg: Config) -> ShardDataset | SyntheticDataset:
    joint, pooled = text_dims(cfg.model.preset)
    if cfg.data.synthetic_samples:
        side = cfg.data.resolution // 8
        return SyntheticDataset(cfg.data.synthetic_samples, (16, side, side), cfg.data.text_tokens, joint, pooled,
                                cfg.data.seed)
    if cfg.data.path is None:
        raise DataError("no data: set data.path to a folder made by `sd3cluster prepare`, or data.synthetic_samples")
    ds = ShardDataset(cfg.data.path)
    if ds.shapes["prompt_embeds"][-1] != joint or ds.shapes["pooled"][-1] != pooled:
        raise DataError(f"{cfg.data.path}: text embeddings are {ds.shapes['prompt_embeds'][-1]} wide (pooled "
                        f"{ds.shapes['pooled'][-1]}) but model.preset={cfg.model.preset} reads {joint} ({pooled}); "
                        "prepare the data with matching encoders or pick the matching preset")
    if ds.shapes["latents"][0] != 16:
        raise DataError(f"{cfg.data.path}: latents have {ds.shapes['latents'][0]} channels, SD3 needs 16")
    return ds


# Optimizer group keys that say how it steps, not what it computes: kept as built when a checkpoint is loaded.
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


class Trainer:
    """Everything a run holds: model, optimizer, schedule, EMA, sampler and step, saved and restored together."""

    def __init__(self, cfg: Config, rt: Runtime, fixed_batch: bool = False):
        """fixed_batch: the same samples, noise and timesteps every step (the overfitting check)."""
        self.cfg, self.rt, self.fixed_noise = cfg, rt, fixed_batch
        cuda = rt.device.type == "cuda"
        self.bf16 = cfg.train.precision == "bf16" and cuda
        base_dtype = self._lora_base_dtype() if cfg.train.mode == "lora" else torch.float32
        model = build_transformer(cfg.model.preset, cfg.model.pretrained, device=rt.device, seed=cfg.train.seed,
                                  dtype=base_dtype)
        self.parameters_count = count_parameters(model)
        self.description = transformer_description(model, cfg.model.preset, cfg.model.fuse_qkv)
        self.attention, why = resolve_backend(cfg.model.attention, rt.device)
        attention_note = f"attention: {why}" if cfg.model.fuse_qkv else \
            "attention: diffusers' processor (model.fuse_qkv=false; model.attention applies to the fused model)"
        self.norm, norm_why = resolve_norm(cfg.model.norm, rt.device)
        self.layout, layout_why = resolve_layout(cfg.model.layout, cfg.model.fuse_qkv, self.attention, self.norm)
        adapted_by = ("LoRA adapters" if cfg.train.mode == "lora" else
                      f"float8 ({cfg.model.float8})" if cfg.model.float8 != "none" else None)
        self.projections, projections_why = resolve_projections(cfg.model.projections, rt.device, self.bf16,
                                                                self.layout, adapted_by)
        if cfg.model.fuse_qkv:
            fuse_qkv(model, attention_backend=self.attention, sequence_first=self.layout == "sequence",
                     projections=self.projections)
        self.mlp, mlp_why = resolve_mlp(cfg.model.mlp, rt.device, self.bf16, cfg.train.mode == "lora")
        if self.mlp == "quack":
            fuse_mlp(model)
        if self.norm == "triton":
            norm_why += f", in {fuse_norms(model)} joint blocks (the others keep diffusers' norms)"
        self.kernel_note = (f"{attention_note}; feed-forward: {mlp_why}; adaLN norms: {norm_why}; "
                            f"block layout: {layout_why}; attention projections: {projections_why}")
        if cfg.model.float8 != "none":
            if not cuda:
                raise UserError(f"model.float8={cfg.model.float8} needs a GPU with float8 tensor cores; set "
                                "model.float8=none on this device")
            convert_to_float8(model, cfg.model.float8)
        self.lora: dict[str, Any] | None = None
        if cfg.train.mode == "lora":
            self.lora = self._add_adapters(model)
        self.fsdp = rt.distributed and cfg.train.parallel == "fsdp"
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.adamw_kernel, adamw_why = resolve_adamw_kernel(cfg.optim.kernel, cfg.optim.optimizer, cfg.optim.fused,
                                                            rt.device, trainable, sharded=self.fsdp)
        self.weights, weights_why = resolve_weights(cfg.train.weights, self.adamw_kernel, self.bf16, cfg.train.mode,
                                                    cfg.model.float8, cfg.train.grad_accum)
        self.kernel_note += f"; optimizer: {adamw_why}; weights: {weights_why}"
        # bf16 weights: before DDP, whose buckets take the gradients' dtype when it is built
        self.masters = bf16_weights_with_fp32_masters(trainable) if self.weights == "bf16" else None
        self.model = parallelize(model, rt, cfg.train.parallel, cfg.model.compile and cuda,
                                 cfg.model.activation_checkpointing, self.bf16, cfg.train.ordered_reduce,
                                 cfg.train.fsdp_cpu_offload)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        groups = lora_param_groups(unwrap(self.model), cfg.lora, cfg.optim.lr) if self.lora else self.params
        self.optimizer = make_optimizer(groups, cfg.optim, rt.device, self.adamw_kernel, self.masters)
        # LoRA checkpoints hold the adapters and their optimizer state only: the frozen base is rebuilt from
        # model.pretrained (or the preset's seeded init) and is not saved again with every step.
        self.state_options = StateDictOptions(ignore_frozen_params=self.lora is not None)
        self.scheduler = make_warmup(self.optimizer, cfg.optim.warmup_steps)
        self.ema = EMA(self.model, cfg.train.ema_decay, self.masters) if cfg.train.ema_decay > 0 else None
        self.dataset = open_dataset(cfg)
        self.micro_batch = cfg.data.batch_size
        self.global_micro = self.micro_batch * rt.world
        # fixed_batch: every rank reads the same samples and noise, so the overfit check's curve does not
        # depend on the cluster's size (a batch that grew with the world was harder to memorise: the tiny
        # model reached 0.45 of its first loss in 60 steps on 5 ranks, 0.24 on 2).
        self.data_rank, data_world = (0, 1) if fixed_batch else (rt.rank, rt.world)
        self.data_batch = self.micro_batch * data_world
        buckets = self.dataset.sample_buckets() if isinstance(self.dataset, ShardDataset) else None
        if buckets is not None:  # aspect-ratio buckets: every micro-batch holds one bucket's shape
            self.sampler = BucketBatchSampler(buckets, self.data_batch, self.data_rank, data_world, cfg.data.seed,
                                              shuffle=not fixed_batch)
        else:
            self.sampler = DistributedBatchSampler(len(self.dataset), self.data_batch, self.data_rank, data_world,
                                                   cfg.data.seed, shuffle=not fixed_batch)
        self.latent_shape = tuple(self.dataset.shapes["latents"])
        self.reader = ReadAhead(self._read_micro_batch)
        self.step = 0

    def _lora_base_dtype(self) -> torch.dtype:
        """The frozen base's dtype (lora.base_dtype); the model is built in it, the adapters added later are fp32."""
        base = self.cfg.lora.base_dtype
        if base == "auto":
            base = "bf16" if self.bf16 else "fp32"
        if base == "bf16" and not self.bf16:
            raise UserError("lora.base_dtype=bf16 needs bf16 compute (train.precision=bf16 on a GPU); set "
                            "lora.base_dtype=fp32 or auto")
        return torch.bfloat16 if base == "bf16" else torch.float32

    def _add_adapters(self, model: torch.nn.Module) -> dict[str, Any]:
        cfg = self.cfg
        names = apply_lora(model, cfg.lora, cfg.model.fuse_qkv, cfg.train.seed)
        return lora_describe(cfg.lora, cfg.model.fuse_qkv, names)

    # -- input of one micro-step ----------------------------------------------------------------------------
    def _read_micro_batch(self, key: tuple[tuple[int, ...], int]) -> tuple[Batch, torch.Tensor, torch.Tensor]:
        """This rank's samples, noise and timesteps of one micro-step: a pure function of (indices, noise index),
        so ReadAhead may run it early on its thread. Pinned host memory makes the copy to the GPU asynchronous."""
        indices, noise_index = key
        batch = self.dataset.get(list(indices))
        first = noise_index * self.data_batch + self.data_rank * self.micro_batch
        noise, sigmas = sample_noise(self.cfg.flow, self.cfg.train.seed, first, self.micro_batch,
                                     tuple(batch.latents.shape[1:]))
        if self.rt.device.type == "cuda":
            batch, noise, sigmas = batch.pin_memory(), noise.pin_memory(), sigmas.pin_memory()
        return batch, noise, sigmas

    def _noise_index(self, micro_step: int) -> int:
        return 0 if self.fixed_noise else micro_step

    def _next_micro_batch(self, micro: int) -> tuple[Batch, torch.Tensor, torch.Tensor]:
        accum = self.cfg.train.grad_accum
        micro_step = self.step * accum + micro
        key = (tuple(self.sampler.next_indices()), self._noise_index(micro_step))
        next_key = (tuple(self.sampler.peek_indices()), self._noise_index(micro_step + 1))
        batch, noise, sigmas = self.reader.take(key, next_key)
        device = self.rt.device
        return batch.to(device), noise.to(device, non_blocking=True), sigmas.to(device, non_blocking=True)

    def close(self) -> None:
        self.reader.close()

    # -- one optimizer step -------------------------------------------------------------------------------
    def _sync_context(self, last_micro: bool) -> contextlib.AbstractContextManager:
        if last_micro or not (self.fsdp or isinstance(self.model, DistributedDataParallel)):
            return contextlib.nullcontext()
        if self.fsdp:
            self.model.set_requires_gradient_sync(False)
            return contextlib.nullcontext()
        return self.model.no_sync()

    def train_step(self) -> dict[str, float]:
        """One optimizer step; its loss, gradient norm and learning rate as numbers (waits for the device)."""
        return {k: float(v) for k, v in self.step_async().items()}

    def step_async(self) -> dict[str, torch.Tensor | float]:
        """One optimizer step, queued: loss and gradient norm stay device tensors, so the host goes on to queue
        the next step while this one runs (reading them waits for it)."""
        cfg, rt = self.cfg, self.rt
        accum = cfg.train.grad_accum
        total = torch.zeros((), device=rt.device)
        autocast = torch.autocast(rt.device.type, dtype=torch.bfloat16, enabled=self.bf16 and not self.fsdp)
        in_dtype = torch.bfloat16 if self.bf16 and self.fsdp else torch.float32
        for micro in range(accum):
            batch, noise, sigmas = self._next_micro_batch(micro)
            last = micro == accum - 1
            if self.fsdp and last:
                self.model.set_requires_gradient_sync(True)
            with self._sync_context(last), autocast:
                loss = flow_loss(self.model, cfg.flow, batch.latents.to(in_dtype), batch.prompt_embeds.to(in_dtype),
                                 batch.pooled.to(in_dtype), noise.to(in_dtype), sigmas.to(in_dtype)) / accum
            loss.backward()
            total += loss.detach()
        if isinstance(self.optimizer, TritonAdamW):  # the norm and the clip inside the optimizer's own launches
            self.optimizer.step(max_norm=cfg.optim.grad_clip)
            norm = self.optimizer.grad_norm
        else:
            if cfg.optim.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        self.step += 1
        mean_loss = all_reduce(rt, total.clone()) / rt.world
        return {"loss": mean_loss, "grad_norm": norm, "lr": self.scheduler.get_last_lr()[0]}

    # -- state ----------------------------------------------------------------------------------------------
    def tensor_state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.state_options)
        if self.masters is not None:
            # bf16 weights: the checkpoint holds their fp32 masters, as an fp32 run holds its weights (export and
            # an fp32 resume read it as one); loading fills the masters, and set_state_dict rounds the weights
            for name, p in unwrap(self.model).named_parameters():
                if p in self.masters:
                    if name not in model_sd:
                        raise RuntimeError(f"the state dict names no {name}; its masters would not be saved")
                    model_sd[name] = self.masters[p]
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def trainer_state(self) -> dict[str, Any]:
        # torchao's optimizers keep each group's lr as a tensor (no recompilation when it changes): as numbers here.
        scheduler = json.loads(json.dumps(self.scheduler.state_dict(),
                                          default=lambda t: t.tolist() if isinstance(t, torch.Tensor) else str(t)))
        return {"step": self.step, "sampler": self.sampler.state_dict(), "scheduler": scheduler,
                "world": self.rt.world, "global_micro_batch": self.global_micro, "model": self.description,
                "pretrained": str(self.cfg.model.pretrained) if self.cfg.model.pretrained else None,
                "ema": self.ema is not None, "mode": self.cfg.train.mode, "lora": self.lora}

    def load(self, manager: CheckpointManager, path: Path) -> None:
        if (Path(path) / "trainer.json").is_file():
            saved = read_trainer_json(path)
            check_checkpoint_kind(path, saved, self.cfg.train.mode, self.lora)
            # Other model settings would fail inside DCP as tensors that do not fit: say which settings differ.
            differ = model_differences(saved["model"], self.description) if saved.get("model") else []
            if differ:
                raise CheckpointError(f"checkpoint {path} was written with other model settings ({'; '.join(differ)}); "
                                      "set them as that run had them to resume it, or point checkpoint.dir elsewhere "
                                      "(or set checkpoint.resume=never) to start a new run")
        tensors = self.tensor_state()
        trainer = manager.load(path, tensors)
        options = StateDictOptions(ignore_frozen_params=True, strict=False) if self.lora else None
        # The saved groups' implementation keys (fused, foreach, ...) are the writer's: a checkpoint of the Triton
        # AdamW carries fused=None, which would turn torch's fused AdamW into its slower foreach path.
        built = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in self.optimizer.param_groups]
        set_state_dict(self.model, self.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors["optim"], options=options)
        for group, keys in zip(self.optimizer.param_groups, built, strict=True):
            group.update(keys)
        if self.ema is not None and "ema" in tensors:
            self.ema.load_state_dict(tensors["ema"])
        self.step = int(trainer["step"])
        self.sampler.load_state_dict(trainer["sampler"])
        self.scheduler.load_state_dict(trainer["scheduler"])

    def save(self, manager: CheckpointManager) -> Path:
        return manager.save(self.step, self.tensor_state(), self.trainer_state())

    def flat_parameters(self) -> torch.Tensor:
        """All parameters as one fp32 vector (full tensors, also under FSDP; the fp32 masters of bf16 weights)."""
        parts = []
        for p in unwrap(self.model).parameters():
            source = self.masters.get(p, p) if self.masters is not None else p
            t = source.full_tensor() if hasattr(source, "full_tensor") else source
            parts.append(t.detach().float().flatten().cpu())
        return torch.cat(parts)


class MetricsLogger:
    """Rank 0 only: a progress bar (loss, images/s, MFU, ETA), TensorBoard scalars and metrics.jsonl."""

    def __init__(self, cfg: Config, rt: Runtime, total_steps: int, start_step: int, flops_per_image: float):
        self.rt, self.cfg = rt, cfg
        self.flops_per_image = flops_per_image
        self.peak = cfg.train.peak_tflops * 1e12 * rt.world
        self.bar = self.tb = self.jsonl = None
        if not rt.is_main:
            return
        out = cfg.output.dir
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out / "metrics.jsonl", "a")
        if cfg.output.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        if cfg.output.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float], images_per_s: float) -> None:
        if not self.rt.is_main:
            return
        mfu = self.flops_per_image * images_per_s / self.peak
        record = {"step": step, **metrics, "images_per_s": images_per_s, "mfu": mfu, "time": time.time()}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("step", "time"):
                    self.tb.add_scalar(f"train/{key}", value, step)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", img_s=f"{images_per_s:.1f}", mfu=f"{mfu:.3f}")
            self.bar.update(step - self.bar.n)

    def note(self, text: str) -> None:
        if self.rt.is_main:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()


def _maybe_kill(cfg: Config, rt: Runtime, step: int) -> None:
    """Test hook: a worker dies hard (as a lost node would) on the first attempt only."""
    if cfg.train.kill_at_step and step == cfg.train.kill_at_step and rt.rank == cfg.train.kill_rank \
            and rt.restart_count == 0:
        print(f"[rank {rt.rank}] fault injection: SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def train(cfg: Config, rt: Runtime) -> dict[str, Any]:
    """`sd3cluster train`: resume if a complete checkpoint exists, run to train.steps, checkpoint on the way."""
    trainer = Trainer(cfg, rt)
    manager = CheckpointManager(cfg.checkpoint.dir, rt, cfg.checkpoint.keep) if cfg.checkpoint.dir else None
    resumed_from = None
    if manager is not None and cfg.checkpoint.resume != "never":
        path = manager.latest() if cfg.checkpoint.resume == "auto" else Path(cfg.checkpoint.resume)
        if path is not None:
            trainer.load(manager, path)
            resumed_from = str(path)
    side = cfg.data.resolution
    if trainer.latent_shape[-1] * 8 != side:
        side = trainer.latent_shape[-1] * 8
    # MFU counts the FLOPs of the unmodified diffusers model, as `bench` does (models.train_flops_per_image).
    flops = train_flops_per_image(cfg.model.preset, side, trainer.dataset.shapes["prompt_embeds"][0])
    log = MetricsLogger(cfg, rt, cfg.train.steps, trainer.step, flops)
    if resumed_from:
        log.note(f"resumed from {resumed_from} at step {trainer.step} (restart {rt.restart_count})")
    wrapped = trainer.fsdp or isinstance(trainer.model, DistributedDataParallel)
    log.note(f"model {cfg.model.preset}: {trainer.parameters_count:,} parameters; {rt.world} rank(s) on "
             f"{rt.device.type} ({rt.backend if rt.distributed else 'single process'}); parallel "
             f"{cfg.train.parallel if wrapped else 'none'}; global batch {trainer.global_micro * cfg.train.grad_accum}")
    log.note(trainer.kernel_note)
    images_per_step = trainer.global_micro * cfg.train.grad_accum
    previewer = None
    if cfg.preview.every:
        from .preview import Previewer

        previewer = Previewer(cfg, rt, trainer.model, trainer.bf16, trainer.fsdp)
        log.note(f"previews of {len(cfg.preview.prompts)} prompt(s) every {cfg.preview.every} steps "
                 f"({previewer.source}) -> {cfg.output.dir / 'previews'}")
    try:
        # The host reads a step's loss (and so waits for the device) only where it must: a log line, a
        # checkpoint, a preview, the last step. Between them it queues step n+1 while the device runs step n.
        last, last_step = time.perf_counter(), trainer.step
        metrics: dict[str, float] = {}
        while trainer.step < cfg.train.steps:
            pending = trainer.step_async()
            step = trainer.step
            save = manager is not None and (step % cfg.checkpoint.every == 0 or step == cfg.train.steps)
            preview = previewer is not None and step % cfg.preview.every == 0
            if not (step % cfg.train.log_every == 0 or step == cfg.train.steps or save or preview):
                _maybe_kill(cfg, rt, step)
                continue
            metrics = {k: float(v) for k, v in pending.items()}
            now = time.perf_counter()
            images_per_s = images_per_step * (step - last_step) / max(now - last, 1e-9)
            if not math.isfinite(metrics["loss"]):
                raise FloatingPointError(f"loss became {metrics['loss']} by step {step}; lower optim.lr")
            if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                log.log(step, metrics, images_per_s)
            if save:
                saved = trainer.save(manager)
                log.note(f"checkpoint {saved} (step {step})")
            if preview:
                seconds = previewer.render(step, cfg.output.dir, log.tb)
                log.note(f"previews of step {step} in {seconds:.1f} s")
            last, last_step = time.perf_counter(), step
            _maybe_kill(cfg, rt, step)
    finally:
        log.close()
        trainer.close()
    return {"step": trainer.step, "resumed_from": resumed_from, **metrics}
