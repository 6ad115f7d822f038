"""The whole stack: components wired together, and the outputs (the Ansible inventory among them)."""

from __future__ import annotations

from typing import Any

import pulumi

from .access import ClusterAccess
from .compute import GpuNodes, HeadNode
from .config import AwsClusterConfig
from .host_keys import public_line
from .inventory import HostRecord, build_inventory, host_names, known_hosts_name
from .network import ClusterNetwork
from .storage import SharedFileSystem

AWS_MTU = 9001


def _inventory(config: AwsClusterConfig, network_cidr: str, head_name: str, gpu_names: list[str],
               resolved: list[Any]) -> dict[str, Any]:
    head_private, head_public, shared, head_key, *rest = resolved
    addresses, keys = rest[:len(gpu_names)], rest[len(gpu_names):]
    head = HostRecord(name=head_name, private_ip=head_private, public_ip=head_public,
                      public_key=public_line(head_key, head_name))
    gpu_nodes = [
        HostRecord(name=name, private_ip=address, public_key=public_line(key, name),
                   gpus=config.gpu_instance_type.gpus, efa_interfaces=config.efa_interfaces,
                   efa_device_rdma=config.efa_device_rdma)
        for name, address, key in zip(gpu_names, addresses, keys, strict=True)
    ]
    return build_inventory(cluster_name=config.cluster_name, network_cidr=network_cidr, ssh_user=config.ssh_user,
                           head=head, gpu_nodes=gpu_nodes, shared_filesystem=shared,
                           storage=config.shared_filesystem, mtu=AWS_MTU)


def build(config: AwsClusterConfig) -> dict[str, pulumi.Output[Any] | Any]:
    """Declare every resource of the cluster; return the stack outputs: the Ansible inventory (read by
    inventories/cloud) and the command that logs in to the head (for people)."""
    head_name, gpu_names = host_names(config.cluster_name, config.gpu_node_count)
    network = ClusterNetwork(config.cluster_name, config)
    access = ClusterAccess(config.cluster_name, config, vpc_id=network.vpc.id)
    head = HeadNode(f"{config.cluster_name}-head", config, head_name, subnet_id=network.public_subnet.id,
                    security_group_ids=[access.cluster_group.id, access.ssh_group.id],
                    key_name=access.key_pair.key_name)
    gpu_nodes = GpuNodes(f"{config.cluster_name}-gpu", config, gpu_names, subnet_id=network.private_subnet.id,
                         security_group_ids=[access.cluster_group.id], key_name=access.key_pair.key_name)
    if config.shared_filesystem == "none":
        shared: pulumi.Input[dict[str, Any]] = {}
    else:
        shared = SharedFileSystem(f"{config.cluster_name}-shared", config, subnet_id=network.private_subnet.id,
                                  security_group_id=access.cluster_group.id).mount

    inventory = pulumi.Output.all(
        head.instance.private_ip, head.public_address.public_ip, shared, head.host_key.public_key_openssh,
        *(instance.private_ip for instance in gpu_nodes.instances),
        *(key.public_key_openssh for key in gpu_nodes.host_keys),
    ).apply(lambda resolved: _inventory(config, network.cidr, head_name, gpu_names, resolved))

    return {
        # The known_hosts file is the one inventories/cloud writes (pulumi/README.md).
        "ssh_command": head.public_address.public_ip.apply(
            lambda ip: f"ssh -o StrictHostKeyChecking=yes -o UserKnownHostsFile=~/.ssh/"
                       f"{known_hosts_name(config.cluster_name)} {config.ssh_user}@{ip}"),
        "ansible_inventory": inventory,
    }
