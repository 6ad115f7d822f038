"""cloud-init user data: only what Ansible cannot do before it can log in (host name, the SSH user)."""

from __future__ import annotations


def cloud_init(hostname: str, ssh_user: str = "ubuntu") -> str:
    """A #cloud-config that names the host as the inventory does, so /etc/hosts and Slurm agree with it.

    Packages are left to Ansible: a boot that upgrades the kernel would race the driver role.
    """
    return "\n".join([
        "#cloud-config",
        f"hostname: {hostname}",
        "preserve_hostname: false",
        "manage_etc_hosts: false",
        "package_update: false",
        "package_upgrade: false",
        f"system_info: {{default_user: {{name: {ssh_user}}}}}",
        "",
    ])

