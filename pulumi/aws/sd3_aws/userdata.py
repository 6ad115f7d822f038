"""cloud-init user data: only what Ansible cannot do before it can log in (host name, SSH user, host key)."""

from __future__ import annotations

import json

from .host_keys import HostKey


def cloud_init(hostname: str, host_key: HostKey, ssh_user: str = "ubuntu") -> str:
    """A #cloud-config that names the host as the inventory does (so /etc/hosts and Slurm agree with it) and
    installs the host key whose public half the inventory's known_hosts holds.

    Packages are left to Ansible: a boot that upgrades the kernel would race the driver role. Only the
    Ed25519 key is installed and no other type is generated, so the key in known_hosts is the one sshd offers.
    """
    # JSON strings are YAML strings: the key's newlines and the names need no YAML quoting rules.
    return "\n".join([
        "#cloud-config",
        f"hostname: {json.dumps(hostname)}",
        "preserve_hostname: false",
        "manage_etc_hosts: false",
        "package_update: false",
        "package_upgrade: false",
        f"system_info: {{default_user: {{name: {json.dumps(ssh_user)}}}}}",
        "ssh_deletekeys: true",
        "ssh_genkeytypes: []",
        "ssh_keys:",
        f"  ed25519_private: {json.dumps(host_key.private_openssh)}",
        f"  ed25519_public: {json.dumps(host_key.public_openssh)}",
        "",
    ])
