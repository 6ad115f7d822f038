"""GPU instance types this stack knows, with what placement, EFA and the nodes' roles need from each.

EFA interface counts are the number of network cards that carry an EFA device (AWS's EFA guide, per type);
one interface per card is what NCCL over aws-ofi-nccl expects. `efa_device_rdma`: the type's EFA devices do
RDMA reads and writes straight to GPU memory (GPUDirect RDMA: p4d and later), so libfabric may be told to use
it (FI_EFA_USE_DEVICE_RDMA=1); on the g-types EFA moves data through host memory.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInstanceType:
    name: str
    gpus: int
    efa_interfaces: int
    # Secondary cards can be EFA-only (no IP address), which saves addresses in the subnet.
    efa_only_secondaries: bool = False
    efa_device_rdma: bool = False


_TYPES = (
    GpuInstanceType("p6-b200.48xlarge", 8, 8, efa_only_secondaries=True, efa_device_rdma=True),
    GpuInstanceType("p5en.48xlarge", 8, 16, efa_only_secondaries=True, efa_device_rdma=True),
    GpuInstanceType("p5e.48xlarge", 8, 32, efa_only_secondaries=True, efa_device_rdma=True),
    GpuInstanceType("p5.48xlarge", 8, 32, efa_only_secondaries=True, efa_device_rdma=True),
    GpuInstanceType("p5.4xlarge", 1, 0),
    GpuInstanceType("p4de.24xlarge", 8, 4, efa_device_rdma=True),
    GpuInstanceType("p4d.24xlarge", 8, 4, efa_device_rdma=True),
    GpuInstanceType("g6e.xlarge", 1, 0),
    GpuInstanceType("g6e.2xlarge", 1, 0),
    GpuInstanceType("g6e.4xlarge", 1, 0),
    GpuInstanceType("g6e.8xlarge", 1, 1),
    GpuInstanceType("g6e.12xlarge", 4, 1),
    GpuInstanceType("g6e.16xlarge", 1, 1),
    GpuInstanceType("g6e.24xlarge", 4, 2),
    GpuInstanceType("g6e.48xlarge", 8, 4),
    GpuInstanceType("g5.48xlarge", 8, 1),
)

GPU_INSTANCE_TYPES: dict[str, GpuInstanceType] = {t.name: t for t in _TYPES}
