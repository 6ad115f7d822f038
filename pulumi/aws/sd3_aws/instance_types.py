"""GPU instance types this stack knows, with what placement and EFA need from each.

EFA interface counts are the number of network cards that carry an EFA device (AWS's EFA guide, per type);
one interface per card is what NCCL over aws-ofi-nccl expects.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInstanceType:
    name: str
    gpus: int
    gpu_model: str
    gpu_memory_gib: int
    efa_interfaces: int
    # Secondary cards can be EFA-only (no IP address), which saves addresses in the subnet.
    efa_only_secondaries: bool = False

    @property
    def supports_efa(self) -> bool:
        return self.efa_interfaces > 0


_TYPES = (
    GpuInstanceType("p6-b200.48xlarge", 8, "B200", 179, 8, efa_only_secondaries=True),
    GpuInstanceType("p5en.48xlarge", 8, "H200", 141, 16, efa_only_secondaries=True),
    GpuInstanceType("p5e.48xlarge", 8, "H200", 141, 32, efa_only_secondaries=True),
    GpuInstanceType("p5.48xlarge", 8, "H100", 80, 32, efa_only_secondaries=True),
    GpuInstanceType("p5.4xlarge", 1, "H100", 80, 0),
    GpuInstanceType("p4de.24xlarge", 8, "A100", 80, 4),
    GpuInstanceType("p4d.24xlarge", 8, "A100", 40, 4),
    GpuInstanceType("g6e.xlarge", 1, "L40S", 48, 0),
    GpuInstanceType("g6e.2xlarge", 1, "L40S", 48, 0),
    GpuInstanceType("g6e.4xlarge", 1, "L40S", 48, 0),
    GpuInstanceType("g6e.8xlarge", 1, "L40S", 48, 1),
    GpuInstanceType("g6e.12xlarge", 4, "L40S", 48, 1),
    GpuInstanceType("g6e.16xlarge", 1, "L40S", 48, 1),
    GpuInstanceType("g6e.24xlarge", 4, "L40S", 48, 2),
    GpuInstanceType("g6e.48xlarge", 8, "L40S", 48, 4),
    GpuInstanceType("g5.48xlarge", 8, "A10G", 24, 1),
)

GPU_INSTANCE_TYPES: dict[str, GpuInstanceType] = {t.name: t for t in _TYPES}


def gpu_instance_type(name: str) -> GpuInstanceType:
    """The table entry for `name`; KeyError names the known types."""
    try:
        return GPU_INSTANCE_TYPES[name]
    except KeyError:
        known = ", ".join(sorted(GPU_INSTANCE_TYPES))
        raise KeyError(f"unknown GPU instance type '{name}'; known types: {known}") from None
