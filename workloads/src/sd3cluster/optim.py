"""Optimizer pieces: AdamW (fused where the device has it), warmup schedule, bf16 weights with fp32 masters, EMA."""

from __future__ import annotations

import torch
from torch import nn

from .config import OptimConfig
from .errors import UserError


def make_adamw(params: list[torch.Tensor], cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    fused = cfg.fused and device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=fused or None, foreach=None if fused else False)


def make_optimizer(params: list, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """optim.optimizer's choice over `params` (tensors, or param groups with their own lr)."""
    if cfg.optimizer == "adamw":
        return make_adamw(params, cfg, device)
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


class MasterWeightAdamW:
    """Model weights in bf16 (no casts in the step); fp32 masters and fused AdamW state beside them.

    After backward the bf16 gradients are copied into fp32 master gradients, AdamW updates the masters and the
    result is cast back into the model's weights: the update has fp32 precision, the forward/backward bf16 speed.
    """

    def __init__(self, model: nn.Module, cfg: OptimConfig, device: torch.device):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        self.optimizer = make_adamw(self.masters, cfg, device)
        self.param_groups = self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad for p in self.params]
        torch._foreach_copy_([m.grad for m in self.masters], grads)
        self.optimizer.step()
        torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class EMA:
    """Exponential moving average of the (local shards of the) parameters, kept in fp32."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"ema.{i}": t for i, t in enumerate(self.shadow)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, t in enumerate(self.shadow):
            t.copy_(state[f"ema.{i}"])
