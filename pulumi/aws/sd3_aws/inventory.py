"""The Ansible inventory of a cluster, made from the stack's outputs (a pure function; no Pulumi here).

The head is the only host with a public address; GPU nodes are reached through it. Variables that the stack
decides go under `pulumi_*` names in `all.vars`, and inventories/cloud/group_vars/all.yml maps them to the
project's `cluster_*` variables (group_vars/all of an inventory outranks the inventory script's own vars).
Per-host facts of the instance type (GPUs, EFA) are host variables, which outrank group_vars.

Host keys are strict: every node's key is known before its first boot (host_keys.py); the inventory carries
the known_hosts lines, which inventories/cloud/pulumi_inventory.py writes to the file `pulumi_known_hosts_file`
names, and every SSH connection (and the hop through the head) checks against that file alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GROUPS = ("head", "gpu_nodes", "storage_nodes")
# sharedFileSystem -> the storage layer's cluster_storage_backend. Without an AWS file system the head
# exports one over NFS: GlusterFS would need brick disks that the instances do not have.
STORAGE_BACKENDS = {"fsx-lustre": "fsx_lustre", "efs": "efs", "none": "nfs"}
KNOWN_HOSTS_FILE = "{{ pulumi_known_hosts_file }}"


@dataclass(frozen=True)
class HostRecord:
    name: str
    private_ip: str
    public_key: str  # "ssh-ed25519 AAAA...": the host key the node is given at boot
    public_ip: str | None = None
    gpus: int = 0
    efa_interfaces: int = 0
    efa_device_rdma: bool = False


def _strict(known_hosts_file: str) -> str:
    return f"-o StrictHostKeyChecking=yes -o UserKnownHostsFile={known_hosts_file}"


def _proxy_args(ssh_user: str, head_public_ip: str, known_hosts_file: str) -> str:
    # A ProxyCommand (not ProxyJump) so the hop to the head gets the same host-key policy as the node itself.
    strict = _strict(known_hosts_file)
    return f"{strict} -o ProxyCommand=\"ssh {strict} -W %h:%p -q {ssh_user}@{head_public_ip}\""


def known_hosts(head: HostRecord, gpu_nodes: Sequence[HostRecord]) -> list[str]:
    """known_hosts lines: every name and address a host is reached by, with its key."""
    lines = []
    for host in (head, *gpu_nodes):
        names = [name for name in (host.public_ip, host.private_ip, host.name) if name]
        lines.append(f"{','.join(names)} {' '.join(host.public_key.split()[:2])}")
    return lines


def build_inventory(*, cluster_name: str, network_cidr: str, ssh_user: str, head: HostRecord,
                    gpu_nodes: Sequence[HostRecord], shared_filesystem: Mapping[str, Any] | None = None,
                    storage: str = "none", mtu: int = 9001) -> dict[str, Any]:
    """Ansible's JSON inventory (the format `ansible-inventory --list` prints) with head, gpu_nodes, storage_nodes.

    storage: the stack's sharedFileSystem; shared_filesystem: {dns_name, mount_name} of the one it made."""
    if not head.public_ip:
        raise ValueError(f"head {head.name} has no public address: it is the cluster's only SSH entry")
    if storage not in STORAGE_BACKENDS:
        raise ValueError(f"shared file system '{storage}' is none of {', '.join(STORAGE_BACKENDS)}")
    names = [head.name, *(node.name for node in gpu_nodes)]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"host names used twice: {', '.join(duplicates)}")

    hostvars: dict[str, dict[str, Any]] = {
        head.name: {
            "ansible_host": head.public_ip,
            "cluster_address": head.private_ip,
            "ansible_ssh_common_args": _strict(KNOWN_HOSTS_FILE),
        }
    }
    for node in gpu_nodes:
        hostvars[node.name] = {
            "ansible_host": node.private_ip,
            "cluster_address": node.private_ip,
            "ansible_ssh_common_args": _proxy_args(ssh_user, head.public_ip, KNOWN_HOSTS_FILE),
            "cluster_gpus_per_node": node.gpus,
            "efa_interfaces": node.efa_interfaces,
            "efa_device_rdma": node.efa_device_rdma,
        }
    return {
        "all": {
            "children": list(GROUPS),
            "vars": {
                "ansible_user": ssh_user,
                "pulumi_cluster_name": cluster_name,
                "pulumi_cluster_network_cidr": network_cidr,
                "pulumi_cluster_mtu": mtu,
                "pulumi_storage_backend": STORAGE_BACKENDS[storage],
                "pulumi_shared_filesystem": dict(shared_filesystem or {}),
                "pulumi_known_hosts": known_hosts(head, gpu_nodes),
            },
        },
        "head": {"hosts": [head.name]},
        "gpu_nodes": {"hosts": [node.name for node in gpu_nodes]},
        # The shared volume is AWS's (or the head's NFS export): no GlusterFS bricks on the instances.
        "storage_nodes": {"hosts": []},
        "_meta": {"hostvars": hostvars},
    }


def known_hosts_name(cluster_name: str) -> str:
    """The file name under ~/.ssh that inventories/cloud writes the cluster's known_hosts to by default."""
    return f"sd3-{cluster_name}.known_hosts"


def host_names(cluster_name: str, gpu_node_count: int) -> tuple[str, list[str]]:
    """The head's and the GPU nodes' names: short, unique, sorted as they are numbered."""
    width = max(2, len(str(gpu_node_count)))
    return f"{cluster_name}-head", [f"{cluster_name}-gpu-{i:0{width}d}" for i in range(1, gpu_node_count + 1)]
