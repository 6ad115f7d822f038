"""The Ansible inventory of a cluster, made from the stack's outputs (a pure function; no Pulumi here).

The head is the only host with a public address; GPU nodes are reached through it. Variables that the stack
decides go under `pulumi_*` names in `all.vars`, and inventories/cloud/group_vars/all.yml maps them to the
project's `cluster_*` variables (group_vars/all of an inventory outranks the inventory script's own vars).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GROUPS = ("head", "gpu_nodes", "storage_nodes")
MAX_STORAGE_REPLICA = 3


@dataclass(frozen=True)
class HostRecord:
    name: str
    private_ip: str
    instance_id: str
    instance_type: str
    public_ip: str | None = None
    gpus: int = 0
    efa_interfaces: int = 0


def storage_layout(gpu_node_names: Sequence[str]) -> tuple[int, list[str]]:
    """GlusterFS replica count and bricks: replica up to 3, on the largest multiple of it among the GPU nodes."""
    replica = max(1, min(MAX_STORAGE_REPLICA, len(gpu_node_names)))
    usable = (len(gpu_node_names) // replica) * replica
    return replica, list(gpu_node_names[:usable])


def _proxy_args(ssh_user: str, head_public_ip: str) -> str:
    # A ProxyCommand (not ProxyJump) so the hop to the head gets the same host-key policy as the node itself.
    return (f"-o StrictHostKeyChecking=accept-new "
            f"-o ProxyCommand=\"ssh -o StrictHostKeyChecking=accept-new -W %h:%p -q {ssh_user}@{head_public_ip}\"")


def build_inventory(*, cluster_name: str, network_cidr: str, ssh_user: str, head: HostRecord,
                    gpu_nodes: Sequence[HostRecord], shared_filesystem: Mapping[str, Any] | None = None,
                    mtu: int = 9001) -> dict[str, Any]:
    """Ansible's JSON inventory (the format `ansible-inventory --list` prints) with head, gpu_nodes, storage_nodes."""
    if not head.public_ip:
        raise ValueError(f"head {head.name} has no public address: it is the cluster's only SSH entry")
    names = [head.name, *(node.name for node in gpu_nodes)]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"host names used twice: {', '.join(duplicates)}")

    replica, storage_hosts = storage_layout([node.name for node in gpu_nodes])
    hostvars: dict[str, dict[str, Any]] = {
        head.name: {
            "ansible_host": head.public_ip,
            "cluster_address": head.private_ip,
            "ansible_ssh_common_args": "-o StrictHostKeyChecking=accept-new",
            "aws_instance_id": head.instance_id,
            "aws_instance_type": head.instance_type,
        }
    }
    for node in gpu_nodes:
        hostvars[node.name] = {
            "ansible_host": node.private_ip,
            "cluster_address": node.private_ip,
            "ansible_ssh_common_args": _proxy_args(ssh_user, head.public_ip),
            "aws_instance_id": node.instance_id,
            "aws_instance_type": node.instance_type,
            "aws_gpus": node.gpus,
            "aws_efa_interfaces": node.efa_interfaces,
        }
    return {
        "all": {
            "children": list(GROUPS),
            "vars": {
                "ansible_user": ssh_user,
                "pulumi_cluster_name": cluster_name,
                "pulumi_cluster_network_cidr": network_cidr,
                "pulumi_cluster_mtu": mtu,
                "pulumi_storage_replica": replica,
                "pulumi_shared_filesystem": dict(shared_filesystem or {"type": "none"}),
            },
        },
        "head": {"hosts": [head.name]},
        "gpu_nodes": {"hosts": [node.name for node in gpu_nodes]},
        "storage_nodes": {"hosts": storage_hosts},
        "_meta": {"hostvars": hostvars},
    }


def host_names(cluster_name: str, gpu_node_count: int) -> tuple[str, list[str]]:
    """The head's and the GPU nodes' names: short, unique, sorted as they are numbered."""
    width = max(2, len(str(gpu_node_count)))
    return f"{cluster_name}-head", [f"{cluster_name}-gpu-{i:0{width}d}" for i in range(1, gpu_node_count + 1)]
