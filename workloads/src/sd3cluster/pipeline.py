"""Text -> image with SD3: text encoders, MMDiT denoising with classifier-free guidance, VAE decode.

Built from diffusers' components (SD3Transformer2DModel, AutoencoderKL, FlowMatchEulerDiscreteScheduler, the
transformers text encoders) with the package's own speed-ups on the transformer: weights in the compute dtype
(no autocast), fused q/k/v with cuDNN attention on GPUs, and optionally one torch.compile per block. The stages
are separate methods (encode, denoise, decode) so a service can time and batch each one.

Every image's starting noise is drawn on the CPU from its own seed, so an image depends on its seed and prompt
only, never on the batch it ran in, the rank or the device count (up to the batch's floating-point rounding).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .attention import resolve_backend
from .components import CLIP_TOKENS, Encoders, encode_prompts, load_encoders, missing_parts, random_encoders
from .errors import UserError
from .models import build_transformer, fuse_qkv
from .parallel import apply_compile

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# SD3's scheduler settings (scheduler/scheduler_config.json of the published checkpoints).
DEFAULT_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass
class Conditioning:
    """Text embeddings of a batch: the prompts' and (with guidance) the negative prompts'."""

    embeds: torch.Tensor
    pooled: torch.Tensor
    negative_embeds: torch.Tensor | None = None
    negative_pooled: torch.Tensor | None = None


@dataclass
class StageTimes:
    """Seconds per stage of one batch (the device is synchronised at each boundary)."""

    encode: float = 0.0
    denoise: float = 0.0
    decode: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class Stopped(Exception):
    """Denoising was abandoned because nobody waits for its result any more."""


@dataclass
class CfgPair:
    """CFG parallel: two ranks share a batch; member 0 runs the unconditional pass, member 1 the conditional."""

    group: Any
    member: int


class SD3Pipeline:
    def __init__(self, transformer: nn.Module, encoders: Encoders, device: torch.device, dtype: torch.dtype,
                 scheduler_config: dict[str, Any] | None = None, t5_tokens: int = 77, compile_blocks: bool = False,
                 description: str = "", compile_vae: bool = False, training_model: bool = False,
                 attention: str = "auto"):
        """training_model: `transformer` is a model being trained (already fused, compiled and wrapped, fp32
        weights): it is used as it is, under bf16 autocast when `dtype` is bf16. attention: model.attention's
        choice (attention.py) for a transformer that is not the training model."""
        self.device, self.dtype, self.t5_tokens = device, dtype, t5_tokens
        self.description = description
        cuda = device.type == "cuda"
        self.autocast = training_model and dtype == torch.bfloat16
        if training_model:
            self.transformer = transformer
        else:
            transformer = transformer.to(device=device, dtype=dtype).eval().requires_grad_(False)
            self.attention, _ = resolve_backend(attention, device)
            self.transformer = fuse_qkv(transformer, attention_backend=self.attention)
            if compile_blocks and cuda:
                apply_compile(self.transformer)
        self.encoders = encoders.to(device, dtype)
        self.vae = encoders.vae
        self.channels_last = compile_vae and cuda
        if self.channels_last:
            # The VAE decoder is convolutions at up to full image size. Compiled and channels-last it decoded a
            # 1024^2 image in 55 ms on an H200 against 148 ms channels-last eager (eager channels-first lies
            # between), so channels-last comes only with compilation.
            torch.backends.cudnn.benchmark = True
            self.vae.to(memory_format=torch.channels_last)
            self.vae.decoder.compile()
        self.scheduler_config = {**DEFAULT_SCHEDULER, **(scheduler_config or {})}
        self.latent_channels = int(self.vae.config.latent_channels)
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)

    # -- stages ---------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None) -> Conditioning:
        """Embeddings of the prompts and, when given, of the negative prompts (one encoder pass for both)."""
        texts = list(prompts) + list(negative_prompts or [])
        embeds, pooled = encode_prompts(self.encoders, texts, CLIP_TOKENS, self.t5_tokens, self.device)
        embeds, pooled = embeds.to(self.dtype), pooled.to(self.dtype)
        n = len(prompts)
        if negative_prompts is None:
            return Conditioning(embeds, pooled)
        return Conditioning(embeds[:n], pooled[:n], embeds[n:], pooled[n:])

    def initial_noise(self, seeds: list[int], height: int, width: int) -> torch.Tensor:
        """One CPU generator per image, so an image's noise depends on its seed only."""
        shape = (self.latent_channels, height // self.vae_scale, width // self.vae_scale)
        noise = [torch.randn(shape, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float32)
                 for s in seeds]
        return torch.stack(noise).to(self.device)

    def _scheduler(self, steps: int):
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        scheduler.set_timesteps(steps, device=self.device)
        return scheduler

    def _predict(self, latents: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor,
                 ) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.transformer(hidden_states=latents.to(self.dtype), timestep=t.expand(latents.shape[0]),
                                    encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False)[0]

    @torch.no_grad()
    def denoise(self, latents: torch.Tensor, cond: Conditioning, steps: int, guidance: float,
                cfg_pair: CfgPair | None = None, should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Flow-matching Euler steps; with guidance > 1 the unconditional and conditional predictions are
        batched into one pass (or split over the two ranks of `cfg_pair`) and mixed as uncond + g (cond - uncond).
        `should_stop` is asked before each step (the service: every request of the batch was cancelled or timed
        out); when it says yes, Stopped is raised and the rest of the work is dropped."""
        import torch.distributed as dist

        guided = guidance > 1.0
        if guided and cond.negative_embeds is None and cfg_pair is None:
            raise ValueError("guidance > 1 needs the negative prompts' embeddings")
        scheduler = self._scheduler(steps)
        if guided and cfg_pair is None:
            both_embeds = torch.cat([cond.negative_embeds, cond.embeds])
            both_pooled = torch.cat([cond.negative_pooled, cond.pooled])
        for t in scheduler.timesteps:
            if should_stop is not None and should_stop():
                raise Stopped()
            if not guided:
                velocity = self._predict(latents, t, cond.embeds, cond.pooled).float()
            else:
                if cfg_pair is not None:
                    mine = self._predict(latents, t, cond.embeds, cond.pooled).contiguous()
                    halves = [torch.empty_like(mine) for _ in range(2)]
                    dist.all_gather(halves, mine, group=cfg_pair.group)
                    uncond, text = halves[0].float(), halves[1].float()
                else:
                    pred = self._predict(torch.cat([latents, latents]), t, both_embeds, both_pooled).float()
                    uncond, text = pred.chunk(2)
                velocity = uncond + guidance * (text - uncond)
            latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
        return latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents -> uint8 RGB images (batch, height, width, 3), rounded as diffusers' image processor does."""
        config = self.vae.config
        latents = latents / config.scaling_factor + (config.shift_factor or 0.0)
        if self.channels_last:
            latents = latents.to(memory_format=torch.channels_last)
        images = self.vae.decode(latents.to(self.dtype), return_dict=False)[0]
        images = (images.float() / 2 + 0.5).clamp(0, 1)
        return (images.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)

    def __call__(self, prompts: list[str], seeds: list[int], height: int, width: int, steps: int = 28,
                 guidance: float = 7.0, negative_prompts: list[str] | None = None,
                 cfg_pair: CfgPair | None = None) -> tuple[np.ndarray | None, StageTimes]:
        """Images of one batch. Under CFG parallel, member 0 encodes the negative prompts and member 1 the
        prompts; both hold the same latents afterwards and only member 1 decodes (member 0 returns None)."""
        times = StageTimes()
        start = time.perf_counter()
        guided = guidance > 1.0
        negatives = list(negative_prompts) if negative_prompts is not None else [""] * len(prompts)
        if cfg_pair is not None and guided:
            own = negatives if cfg_pair.member == 0 else prompts
            cond = self.encode(own, None)
        else:
            cond = self.encode(prompts, negatives if guided else None)
        self._sync()
        times.encode = time.perf_counter() - start
        start = time.perf_counter()
        latents = self.denoise(self.initial_noise(seeds, height, width), cond, steps, guidance,
                               cfg_pair if guided else None)
        self._sync()
        times.denoise = time.perf_counter() - start
        if cfg_pair is not None and cfg_pair.member == 0:
            return None, times
        start = time.perf_counter()
        images = self.decode(latents)
        times.decode = time.perf_counter() - start
        return images, times


# -- building ---------------------------------------------------------------------------------------------------
def _scheduler_config(folder: Path | None) -> dict[str, Any]:
    path = folder / "scheduler" / "scheduler_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return dict(DEFAULT_SCHEDULER)
    config = json.loads(path.read_text())
    return {k: v for k, v in config.items() if not k.startswith("_")}


def check_pretrained(folder: Path, what: str = "--pretrained") -> Path:
    folder = Path(folder)
    if not folder.exists():
        raise UserError(f"{what} {folder} does not exist; pass a local diffusers SD3 folder")
    if not folder.is_dir():
        raise UserError(f"{what} {folder} is a file; pass a local diffusers SD3 folder")
    return folder


def load_pipeline(preset: str, device: torch.device, dtype: torch.dtype, pretrained: Path | None = None,
                  checkpoint: Path | None = None, step: int | str = "latest", ema: bool = False,
                  t5_tokens: int = 77, compile_blocks: bool = False, log=print, lora: Path | None = None,
                  lora_scale: float = 1.0) -> SD3Pipeline:
    """The transformer from a training checkpoint, a diffusers folder or random init of `preset`; the encoders
    and VAE from the diffusers folder (or the checkpoint run's model.pretrained), else random ones of the preset.
    `lora`: a diffusers-format LoRA merged into the transformer's weights (W += scale B A) before anything else,
    so generating with it costs what generating without it does."""
    from .export import load_trained_transformer, resolve_checkpoint
    from .lora import lora_file, merge_lora

    start = time.perf_counter()
    parts_folder = check_pretrained(pretrained) if pretrained is not None else None
    if lora is not None:
        lora_file(lora)  # a wrong path stops before the weights load
    if checkpoint is not None:
        path = resolve_checkpoint(checkpoint, step)
        transformer, state = load_trained_transformer(path, ema=ema)
        preset = state["model"].get("preset", preset)
        source = f"checkpoint {path} (step {state['step']}{', EMA' if ema else ''})"
        trained_on = state.get("pretrained")
        if parts_folder is None and trained_on and Path(trained_on).is_dir() and not missing_parts(Path(trained_on)):
            parts_folder = Path(trained_on)
    elif parts_folder is not None:
        try:
            transformer = build_transformer(preset, parts_folder)
        except (FileNotFoundError, OSError, ValueError) as e:
            raise UserError(f"--pretrained {parts_folder}: the transformer cannot be loaded "
                            f"({str(e).splitlines()[0][:300]})") from None
        source = f"{parts_folder}/transformer"
    else:
        transformer = build_transformer(preset, device=device)
        source = f"random {preset} transformer"
    if lora is not None:
        merged = merge_lora(transformer, lora, lora_scale)
        source += f" + LoRA {lora} ({merged} layers, scale {lora_scale:g})"
    if parts_folder is not None:
        encoders = load_encoders(parts_folder, torch.device("cpu"), dtype, what="--pretrained")
        parts = str(parts_folder)
    else:
        encoders = random_encoders(preset, device=device, dtype=dtype)
        parts = f"random {preset} encoders and VAE (images show noise; pass --pretrained for real ones)"
    description = f"transformer: {source}; encoders/VAE: {parts}"
    pipe = SD3Pipeline(transformer, encoders, device, dtype, _scheduler_config(parts_folder), t5_tokens,
                       compile_blocks, description, compile_vae=compile_blocks)
    log(f"[pipeline] {description}; {dtype} on {device}{', compiled blocks and VAE decoder' if compile_blocks else ''} "
        f"({time.perf_counter() - start:.1f} s)")
    return pipe
