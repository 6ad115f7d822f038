"""Who may talk to the cluster: security groups and the SSH key pair."""

from __future__ import annotations

import pulumi
import pulumi_aws as aws

from .config import AwsClusterConfig
from .tags import cluster_tags


class ClusterAccess(pulumi.ComponentResource):
    """Two security groups and a key pair.

    `cluster` lets members reach each other on every protocol (EFA's SRD traffic needs inbound and outbound
    rules that reference the group itself) and opens nothing else; `ssh` admits port 22 from the admin
    networks only and is attached to the head alone.
    """

    def __init__(self, name: str, config: AwsClusterConfig, vpc_id: pulumi.Input[str],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:aws:ClusterAccess", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        self.cluster_group = aws.ec2.SecurityGroup(
            f"{name}-cluster",
            description=f"{config.cluster_name}: all traffic between cluster members (EFA, NCCL, storage, Slurm)",
            vpc_id=vpc_id,
            ingress=[aws.ec2.SecurityGroupIngressArgs(
                protocol="-1", from_port=0, to_port=0, self=True, description="cluster members")],
            egress=[
                aws.ec2.SecurityGroupEgressArgs(protocol="-1", from_port=0, to_port=0, self=True,
                                                description="cluster members (EFA needs this rule)"),
                aws.ec2.SecurityGroupEgressArgs(protocol="-1", from_port=0, to_port=0, cidr_blocks=["0.0.0.0/0"],
                                                description="package mirrors and registries, through NAT"),
            ],
            tags=cluster_tags(config.cluster_name, "cluster-sg", extra=config.tags),
            opts=child)

        self.ssh_group = aws.ec2.SecurityGroup(
            f"{name}-ssh",
            description=f"{config.cluster_name}: SSH to the head from the admin networks",
            vpc_id=vpc_id,
            ingress=[aws.ec2.SecurityGroupIngressArgs(
                protocol="tcp", from_port=22, to_port=22, cidr_blocks=list(config.admin_cidrs),
                description="SSH from the admin networks")],
            tags=cluster_tags(config.cluster_name, "ssh-sg", extra=config.tags),
            opts=child)

        self.key_pair = aws.ec2.KeyPair(
            f"{name}-key", public_key=config.ssh_public_key,
            tags=cluster_tags(config.cluster_name, "key", extra=config.tags), opts=child)

        self.register_outputs({
            "cluster_security_group_id": self.cluster_group.id,
            "ssh_security_group_id": self.ssh_group.id,
            "key_name": self.key_pair.key_name,
        })
