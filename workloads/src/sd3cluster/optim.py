"""Optimizer pieces: AdamW (fused where the device has it), warmup schedule, EMA."""

from __future__ import annotations

import torch
from torch import nn

from .config import OptimConfig
from .errors import UserError
from .fused_adamw import TritonAdamW


def make_adamw(params: list, cfg: OptimConfig, device: torch.device, kernel: str,
               masters: dict[torch.Tensor, torch.Tensor] | None = None) -> torch.optim.Optimizer:
    if kernel == "triton":
        return TritonAdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           masters=masters)
    if masters is not None:
        raise ValueError("fp32 masters live in the Triton AdamW (optim.kernel=triton)")
    fused = cfg.fused and device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=fused or None, foreach=None if fused else False)


def make_optimizer(params: list, cfg: OptimConfig, device: torch.device, kernel: str = "torch",
                   masters: dict[torch.Tensor, torch.Tensor] | None = None) -> torch.optim.Optimizer:
    """optim.optimizer's choice over `params` (tensors, or param groups with their own lr); `kernel` is
    optim.kernel resolved (fused_adamw.resolve_adamw_kernel); `masters`: the fp32 masters of bf16 parameters
    (train.weights=bf16), which only the Triton AdamW steps."""
    if cfg.optimizer == "adamw":
        return make_adamw(params, cfg, device, kernel, masters)
    kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "ao_adamw8bit":
        try:
            from torchao.optim import AdamW8bit
        except ImportError:
            raise UserError("optim.optimizer=ao_adamw8bit needs torchao: pip install torchao==0.18.0") from None
        return AdamW8bit(params, **kwargs)
    if device.type != "cuda":
        raise UserError(f"optim.optimizer={cfg.optimizer} is bitsandbytes', which runs on CUDA devices only; use "
                        "adamw or ao_adamw8bit on this device")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError(f"optim.optimizer={cfg.optimizer} needs bitsandbytes: pip install bitsandbytes==0.50.2") \
            from None
    cls = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit,
           "paged_adamw": bnb.optim.PagedAdamW}[cfg.optimizer]
    return cls(params, **kwargs)


def make_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class EMA:
    """Exponential moving average of the (local shards of the) parameters, kept in fp32; of their fp32 masters
    where bf16 parameters have them (`masters`), so the average does not take in bf16's rounding."""

    def __init__(self, model: nn.Module, decay: float, masters: dict[torch.Tensor, torch.Tensor] | None = None):
        self.decay = decay
        self.params = [(masters or {}).get(p, p) for p in model.parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"ema.{i}": t for i, t in enumerate(self.shadow)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, t in enumerate(self.shadow):
            t.copy_(state[f"ema.{i}"])
