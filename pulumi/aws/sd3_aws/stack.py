"""The whole stack: components wired together, and the outputs (the Ansible inventory among them)."""

from __future__ import annotations

from typing import Any

import pulumi

from .access import ClusterAccess
from .compute import GpuNodes, HeadNode
from .config import AwsClusterConfig
from .inventory import HostRecord, build_inventory, host_names
from .network import ClusterNetwork
from .storage import SharedFileSystem

AWS_MTU = 9001


def _inventory(config: AwsClusterConfig, network_cidr: str, head_name: str, gpu_names: list[str],
               resolved: list[Any]) -> dict[str, Any]:
    head_id, head_private, head_public, shared, *nodes = resolved
    node_count = len(gpu_names)
    ids, addresses = nodes[:node_count], nodes[node_count:]
    head = HostRecord(name=head_name, private_ip=head_private, public_ip=head_public, instance_id=head_id,
                      instance_type=config.head_instance_type)
    gpu_nodes = [
        HostRecord(name=name, private_ip=address, instance_id=instance_id,
                   instance_type=config.gpu_instance_type.name, gpus=config.gpu_instance_type.gpus,
                   efa_interfaces=config.efa_interfaces)
        for name, instance_id, address in zip(gpu_names, ids, addresses, strict=True)
    ]
    return build_inventory(cluster_name=config.cluster_name, network_cidr=network_cidr, ssh_user=config.ssh_user,
                           head=head, gpu_nodes=gpu_nodes, shared_filesystem=shared, mtu=AWS_MTU)


def build(config: AwsClusterConfig) -> dict[str, pulumi.Output[Any] | Any]:
    """Declare every resource of the cluster; return the stack outputs."""
    head_name, gpu_names = host_names(config.cluster_name, config.gpu_node_count)
    network = ClusterNetwork(config.cluster_name, config)
    access = ClusterAccess(config.cluster_name, config, vpc_id=network.vpc.id)
    head = HeadNode(f"{config.cluster_name}-head", config, head_name, subnet_id=network.public_subnet.id,
                    security_group_ids=[access.cluster_group.id, access.ssh_group.id],
                    key_name=access.key_pair.key_name)
    gpu_nodes = GpuNodes(f"{config.cluster_name}-gpu", config, gpu_names, subnet_id=network.private_subnet.id,
                         security_group_ids=[access.cluster_group.id], key_name=access.key_pair.key_name)
    if config.shared_filesystem == "none":
        shared: pulumi.Input[dict[str, Any]] = {"type": "none"}
    else:
        shared = SharedFileSystem(f"{config.cluster_name}-shared", config, subnet_id=network.private_subnet.id,
                                  security_group_id=access.cluster_group.id).mount

    inventory = pulumi.Output.all(
        head.instance.id, head.instance.private_ip, head.public_address.public_ip, shared,
        *(instance.id for instance in gpu_nodes.instances),
        *(instance.private_ip for instance in gpu_nodes.instances),
    ).apply(lambda resolved: _inventory(config, network.cidr, head_name, gpu_names, resolved))

    return {
        "cluster_name": config.cluster_name,
        "vpc_id": network.vpc.id,
        "cluster_network_cidr": network.cidr,
        "placement_group": gpu_nodes.placement_group.name,
        "head_public_ip": head.public_address.public_ip,
        "head_private_ip": head.instance.private_ip,
        "gpu_node_private_ips": [instance.private_ip for instance in gpu_nodes.instances],
        "gpu_instance_type": config.gpu_instance_type.name,
        "efa_interfaces_per_node": config.efa_interfaces,
        "shared_filesystem": shared,
        "ssh_command": head.public_address.public_ip.apply(lambda ip: f"ssh {config.ssh_user}@{ip}"),
        "ansible_inventory": inventory,
    }
