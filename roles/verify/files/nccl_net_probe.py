"""A short NCCL all-reduce on this node's GPUs, run by torchrun with NCCL_DEBUG=INFO: its log says which
network NCCL chose (the verify role's tasks/efa.yml reads it). Exits 1 when the sum is wrong."""

import os

import torch
import torch.distributed as dist

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
value = torch.ones(1 << 20, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(value)
world = dist.get_world_size()
expected = world * (world + 1) / 2
dist.destroy_process_group()
raise SystemExit(0 if float(value[0]) == expected else 1)
