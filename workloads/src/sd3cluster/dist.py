"""Distributed state from one place: torchrun's variables (or Slurm's when srun starts the ranks directly)."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    distributed: bool
    restart_count: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    return default


def shared_store_warning(env: dict[str, str]) -> str | None:
    """Restarts with torchrun's shared rendezvous store can hang: say so once, on rank 0 (see workloads/README.md)."""
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0").strip() or "0"
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(restarts) > 0 and env.get("RANK", "0") == "0":
        return ("warning: torchrun shares its rendezvous store with the workers and --max-restarts is on; restarted "
                "workers can hang in init_process_group reading the dead workers' addresses. Export "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun.")
    return None


def pick_device(device: str, index: int = 0) -> torch.device:
    """auto | cpu | cuda -> the device (cuda:index, made current); UserError when CUDA is asked for and absent."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        from .checks import why_no_cuda
        from .errors import UserError

        raise UserError(f"device cuda was asked for, but {why_no_cuda()}; use --device cpu or auto")
    dev = torch.device(f"cuda:{index}") if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def init_runtime(device: str = "auto", timeout_s: int = 600) -> Runtime:
    """Join the process group torchrun (c10d rendezvous) or srun set up; a lone process runs undistributed."""
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    dev = pick_device(device, local_rank)
    launched = "RANK" in os.environ or ("SLURM_PROCID" in os.environ and world > 1)
    if launched and not dist.is_initialized():
        warning = shared_store_warning(dict(os.environ))
        if warning:
            print(warning, file=sys.stderr, flush=True)
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    return Runtime(rank, world, local_rank, dev, dist.is_initialized(),
                   _env_int("TORCHELASTIC_RESTART_COUNT", default=0))


def local_runtime(device: torch.device) -> Runtime:
    """A view of this process alone (the one-process reference runs of `verify`)."""
    return Runtime(0, 1, 0, device, False)


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        dist.barrier()


def all_reduce(rt: Runtime, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    if rt.distributed:
        dist.all_reduce(t, op=op)
    return t


def all_gather_object(rt: Runtime, obj: object) -> list:
    if not rt.distributed:
        return [obj]
    out: list = [None] * rt.world
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(rt: Runtime, obj: object) -> object:
    if not rt.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def raise_on_all(rt: Runtime, error: str | None) -> None:
    """Every rank raises UserError(message) when any rank met one (the lowest rank's message), so no rank is left
    waiting in a collective for a peer that stopped on bad input."""
    errors = [e for e in all_gather_object(rt, error) if e]
    if errors:
        from .errors import UserError

        raise UserError(errors[0])


def hostname() -> str:
    return socket.gethostname()
