"""The shared file system for datasets and checkpoints: FSx for Lustre or EFS, in the private subnet."""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_aws as aws

from .config import AwsClusterConfig
from .tags import cluster_tags


class SharedFileSystem(pulumi.ComponentResource):
    """FSx for Lustre (PERSISTENT_2, for training throughput) or EFS (elastic, NFSv4.1), reachable from the
    cluster security group only. `mount` is what the cloud_fs_client role needs to mount it: {dns_name,
    mount_name (Lustre)}."""

    mount: pulumi.Output[dict[str, Any]]

    def __init__(self, name: str, config: AwsClusterConfig, subnet_id: pulumi.Input[str],
                 security_group_id: pulumi.Input[str], opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:aws:SharedFileSystem", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = cluster_tags(config.cluster_name, "shared-fs", extra=config.tags)

        if config.shared_filesystem == "fsx-lustre":
            lustre = aws.fsx.LustreFileSystem(
                f"{name}-lustre",
                deployment_type="PERSISTENT_2",
                storage_type="SSD",
                storage_capacity=config.fsx_storage_capacity_gb,
                per_unit_storage_throughput=config.fsx_throughput_mb_per_tib,
                file_system_type_version="2.15",
                data_compression_type="LZ4",
                subnet_ids=subnet_id,  # one subnet: a string in pulumi-aws 7
                security_group_ids=[security_group_id],
                tags=tags,
                opts=child)
            self.mount = pulumi.Output.all(lustre.dns_name, lustre.mount_name).apply(
                lambda parts: {"dns_name": parts[0], "mount_name": parts[1]})
        else:
            efs = aws.efs.FileSystem(f"{name}-efs", encrypted=True, performance_mode="generalPurpose",
                                     throughput_mode="elastic", tags=tags, opts=child)
            target = aws.efs.MountTarget(f"{name}-efs-target", file_system_id=efs.id, subnet_id=subnet_id,
                                         security_groups=[security_group_id], opts=child)
            # The name resolves (VPC DNS) once the mount target exists: wait for it.
            self.mount = pulumi.Output.all(efs.dns_name, target.id).apply(lambda parts: {"dns_name": parts[0]})
        self.register_outputs({"mount": self.mount})
