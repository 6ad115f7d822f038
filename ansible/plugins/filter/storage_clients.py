"""The checks of the storage client roles (glusterfs_client, nfs_client) before they change anything: each
problem names the variable and the fix."""
from __future__ import annotations

import re
from collections.abc import Mapping

_NUMBER = re.compile(r"^[0-9]+$")


def _group_problem(variable, group):
    """The group needs a name and a numeric gid (one problem string, or None)."""
    group_ok = isinstance(group, Mapping) and "name" in group and bool(_NUMBER.match(str(group.get("gid", ""))))
    if group_ok:
        return None
    return f"{variable} (cluster_group) is {group}: give it a name and a numeric gid, e.g. {{name: sd3, gid: 2000}}"


def glusterfs_client_problems(servers, mount_path, group, mount_options):
    problems = []
    if len(servers or []) == 0:
        problems.append("glusterfs_client_servers is empty (default: the addresses of storage_nodes): put the "
                        "GlusterFS servers in storage_nodes")
    if not str(mount_path).startswith("/"):
        problems.append(f"glusterfs_client_mount_path (cluster_shared_path) is '{mount_path}': use an absolute path "
                        "such as /shared")
    group_problem = _group_problem("glusterfs_client_group", group)
    if group_problem:
        problems.append(group_problem)
    if any(str(option).startswith("backup-volfile-servers=") for option in mount_options or []):
        problems.append("glusterfs_client_mount_options sets backup-volfile-servers itself: remove it, the role adds "
                        "it from glusterfs_client_servers")
    return problems


def nfs_client_problems(server, export_path, mount_path, mount_options, group):
    problems = []
    if len(str(server)) == 0:
        problems.append("nfs_client_server is empty (default: the head's address): put one host in the head group")
    for variable, value in (("nfs_client_export_path", export_path), ("nfs_client_mount_path", mount_path)):
        if not str(value).startswith("/"):
            problems.append(f"{variable} is '{value}': use an absolute path")
    if "soft" in (mount_options or []):
        problems.append("nfs_client_mount_options holds soft: a soft mount can return short reads and lose checkpoint "
                        "writes; use hard")
    group_problem = _group_problem("nfs_client_group", group)
    if group_problem:
        problems.append(group_problem)
    return problems


class FilterModule:
    def filters(self):
        return {"glusterfs_client_problems": glusterfs_client_problems, "nfs_client_problems": nfs_client_problems}
