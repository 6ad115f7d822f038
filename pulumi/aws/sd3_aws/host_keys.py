"""Each node's SSH host key, made by Pulumi so the inventory can ship known_hosts (strict host keys from the start).

Why: a host key made at first boot is unknown to the machine running Ansible, which then has to trust whatever
answers first (`StrictHostKeyChecking=accept-new`). Here every node has a `tls.PrivateKey` (Ed25519) resource: made
once at the first `pulumi up`, kept in the stack's state as a secret, so later runs give the same user data and a
replaced instance comes back with its old key. The private key goes to cloud-init in the user data; its public half
goes into the inventory's known_hosts.

The private key travels in the instance's user data: anyone who may call ec2:DescribeInstanceAttribute on the
instance, or any process on the node that reads the metadata service, can read it. That is the same trust as the
node's root disk; restrict that IAM action to the cluster's administrators.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_tls as tls


@dataclass(frozen=True)
class HostKey:
    private_openssh: str  # the file cloud-init writes to /etc/ssh/ssh_host_ed25519_key
    public_openssh: str  # "ssh-ed25519 AAAA... <host>"

    def known_hosts_line(self, *names: str) -> str:
        return f"{','.join(names)} {' '.join(self.public_openssh.split()[:2])}"


def node_host_key(resource_name: str, parent: pulumi.Resource) -> tls.PrivateKey:
    return tls.PrivateKey(resource_name, algorithm="ED25519", opts=pulumi.ResourceOptions(parent=parent))


def public_line(public_openssh: str, hostname: str) -> str:
    """tls's "ssh-ed25519 AAAA...\\n" with the host name as its comment."""
    return f"{' '.join(public_openssh.split()[:2])} {hostname}"


def host_key_of(key: tls.PrivateKey, hostname: str) -> pulumi.Output[HostKey]:
    return pulumi.Output.all(key.private_key_openssh, key.public_key_openssh).apply(
        lambda parts: HostKey(private_openssh=parts[0], public_openssh=public_line(parts[1], hostname)))
