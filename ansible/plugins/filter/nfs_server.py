"""The checks of the nfs_server role before it changes anything: each problem names the variable and the fix;
an empty list means fine. Unit-tested in tests/storage/test_nfs_server_filter.py."""
from __future__ import annotations

import re
import runpy
from pathlib import Path

_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
_network = _load("ansible/plugins/filter/cluster_network.py")

_EVERYONE = ("*", "0.0.0.0/0", "::/0")
_NUMBER = re.compile(r"^[0-9]+$")


def nfs_server_problems(settings):
    """`settings`: export_path, export_clients, export_options, threads (the role's variables without the
    nfs_server_ prefix)."""
    problems = []
    export_path = str(settings.get("export_path"))
    clients = list(settings.get("export_clients") or [])
    options = list(settings.get("export_options") or [])
    threads = str(settings.get("threads"))
    if not export_path.startswith("/"):
        problems.append(f"nfs_server_export_path is '{export_path}': use an absolute path such as /srv/nfs/shared")
    if not clients:
        problems.append("nfs_server_export_clients is empty: list the cluster network (cluster_network_cidr), "
                        "e.g. 10.10.0.0/24")
    for client in clients:
        if str(client) in _EVERYONE:
            problems.append(f"nfs_server_export_clients holds '{client}', which exports to everyone: list the "
                            "cluster network only")
        elif not (_network.is_ip_network(client) or _network.is_ip_address(client)):
            problems.append(f"nfs_server_export_clients holds '{client}', not a network or address: use CIDR form, "
                            "e.g. 10.10.0.0/24")
    if "sync" in options and "async" in options:
        problems.append("nfs_server_export_options holds both sync and async: keep one (sync is safe for checkpoints)")
    if "no_root_squash" in options and "root_squash" in options:
        problems.append("nfs_server_export_options holds both root_squash and no_root_squash: keep one (root_squash)")
    if not _NUMBER.match(threads) or not 1 <= int(threads) <= 1024:
        problems.append(f"nfs_server_threads is {threads}: use 1 to 1024 (about 4 per client node)")
    return problems


class FilterModule:
    def filters(self):
        return {"nfs_server_problems": nfs_server_problems}
