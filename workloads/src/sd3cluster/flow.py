"""Rectified flow as diffusers' SD3 training does it: shifted logit-normal timesteps, x_t = (1-s) x0 + s noise."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import FlowConfig


def sample_u(cfg: FlowConfig, n: int, generator: torch.Generator) -> torch.Tensor:
    """Timestep density of the SD3 paper, on [0, 1] (before the scheduler's shift)."""
    if cfg.weighting_scheme == "logit_normal":
        return torch.sigmoid(torch.randn(n, generator=generator) * cfg.logit_std + cfg.logit_mean)
    u = torch.rand(n, generator=generator)
    if cfg.weighting_scheme == "mode":
        u = 1 - u - cfg.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def shift_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler's shift: sigma = shift*u / (1 + (shift-1)*u)."""
    return shift * u / (1 + (shift - 1) * u)


def loss_weighting(cfg: FlowConfig, sigmas: torch.Tensor) -> torch.Tensor:
    if cfg.weighting_scheme == "sigma_sqrt":
        return sigmas.float() ** -2.0
    if cfg.weighting_scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    return torch.ones_like(sigmas)


_MASK64 = (1 << 64) - 1


def sample_key(seed: int, index: int) -> int:
    """A 64-bit generator seed that is a pure function of (run seed, sample number): splitmix64's finalizer over
    seed x golden ratio + index. The finalizer is a bijection, so two samples share a key only when their numbers
    differ by a multiple of 2^64 / gcd, never in a run; unlike seed x constant + index, a run with seed 1 does not
    replay seed 0's noise shifted by a million samples."""
    x = (seed * 0x9E3779B97F4A7C15 + index) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_noise(cfg: FlowConfig, seed: int, first: int, count: int, latent_shape: tuple[int, ...],
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise and sigma of the run's samples first .. first+count-1, each drawn from its own key (sample_key).

    A sample's number is its position in the run's stream of samples (micro-step x global micro-batch + its place
    in that batch). A rank draws its own slice only, so its work does not grow with the cluster (at 64 nodes x 8
    GPUs drawing the whole global batch would be 4 GB of noise a step on every rank), while N ranks still see
    exactly what one process with the global batch sees, k accumulated micro-batches what one k-times batch
    sees, and a resumed run what the uninterrupted one drew.
    """
    noise = torch.empty((count, *latent_shape))
    sigmas = torch.empty(count)
    for i in range(count):
        gen = torch.Generator().manual_seed(sample_key(seed, first + i))
        noise[i] = torch.randn(latent_shape, generator=gen)
        sigmas[i] = shift_sigmas(sample_u(cfg, 1, gen), cfg.shift)[0]
    return noise, sigmas


def flow_loss(model: nn.Module, cfg: FlowConfig, latents: torch.Tensor, prompt_embeds: torch.Tensor,
              pooled: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Mean weighted MSE of one micro-batch; the transformer sees timestep = 1000 * sigma."""
    s = sigmas.view(-1, *([1] * (latents.ndim - 1))).to(latents.dtype)
    noisy = (1.0 - s) * latents + s * noise
    pred = model(hidden_states=noisy, encoder_hidden_states=prompt_embeds, pooled_projections=pooled,
                 timestep=sigmas * 1000.0, return_dict=False)[0]
    if cfg.precondition_outputs:
        pred = pred.float() * (-s) + noisy
        target = latents
    else:
        target = noise - latents
    weight = loss_weighting(cfg, sigmas).view_as(s).to(pred.device)
    per_sample = (weight * (pred.float() - target.float()) ** 2).flatten(1).mean(1)
    return per_sample.mean()
