"""Helpers of the workloads tests: the CLI and torchrun launches of tiny runs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import torch

# Shapes small enough for a 2-core CI machine: 32x32 images -> 4x4 latents -> 4 patches, 8 text tokens.
TINY = ["--set", "data.resolution=32", "--set", "data.text_tokens=8", "--set", "train.precision=fp32"]


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               # torchrun restarts: see workloads/README.md ("Restarts") for why the store is not shared.
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return env


def sd3cluster(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sd3cluster", *args], capture_output=True, text=True,
                          env=run_env(), timeout=timeout, check=False)


def torchrun(nproc: int, *args: str, max_restarts: int = 0, timeout: int = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", f"--max-restarts={max_restarts}", "--monitor-interval=0.5",
           "-m", "sd3cluster", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=run_env(), timeout=timeout, check=False)


def accelerate_launch(nproc: int, port: int, *args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    """`accelerate launch` as the diffusers scripts use it. --multi_gpu is its multi-process launcher (torchrun
    inside) also for CPU ranks; its --cpu mode starts several processes only through mpirun."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}",
           "--num_machines=1", f"--main_process_port={port}", "--mixed_precision=no", "--dynamo_backend=no",
           "-m", "sd3cluster", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=run_env(), timeout=timeout, check=False)


def bf16_as_kernel_rounds(master: torch.Tensor) -> torch.Tensor:
    """The bf16 weight the Triton AdamW writes for an fp32 master: the GPU rounds to nearest even, as torch does;
    Triton's CPU interpreter truncates (its fp32 -> bf16 conversion ignores the rounding mode)."""
    if master.device.type == "cuda":
        return master.to(torch.bfloat16)
    return (master.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def hopper_skip_reason(what: str, import_problem: Callable[[], str | None]) -> str | None:
    """Why a GPU test of an sm90+ kernel (`what`) cannot run here, as its skip reason, or None where it can: the GPU
    machine runs them (benchmarks/sd3_training.md has the command)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability()[0] < 9:
        return f"{what} needs sm90+"
    return import_problem()
