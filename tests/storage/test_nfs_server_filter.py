"""The checks of the nfs_server role (ansible/plugins/filter/nfs_server.py): good settings pass, each bad one
gets its message naming the variable and the fix."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "ansible" / "plugins" / "filter" / "nfs_server.py"
spec = importlib.util.spec_from_file_location("nfs_server_filter_under_test", PATH)
nfs_server = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nfs_server)
problems = nfs_server.FilterModule().filters()["nfs_server_problems"]

GOOD = {"export_path": "/srv/nfs/shared", "export_clients": ["10.10.0.0/24"],
        "export_options": ["rw", "sync", "root_squash", "no_subtree_check", "sec=sys"], "threads": 32}


def check(**changes):
    return problems({**GOOD, **changes})


def test_good_settings_have_no_problem():
    assert check() == []
    assert check(export_clients=["10.10.0.0/24", "10.20.0.7", "fd00::/64"], threads="1") == []
    assert check(threads=1024, export_options=["rw", "async", "no_root_squash"]) == []


@pytest.mark.parametrize(("changes", "problem"), [
    ({"export_path": "srv/nfs"}, "nfs_server_export_path is 'srv/nfs': use an absolute path such as /srv/nfs/shared"),
    ({"export_clients": []}, "nfs_server_export_clients is empty: list the cluster network (cluster_network_cidr), "
                             "e.g. 10.10.0.0/24"),
    ({"export_clients": ["*"]}, "nfs_server_export_clients holds '*', which exports to everyone: list the cluster "
                                "network only"),
    ({"export_clients": ["::/0"]}, "nfs_server_export_clients holds '::/0', which exports to everyone: list the "
                                   "cluster network only"),
    ({"export_clients": ["10.10.0.1/24"]}, "nfs_server_export_clients holds '10.10.0.1/24', not a network or address: "
                                           "use CIDR form, e.g. 10.10.0.0/24"),
    ({"export_clients": ["head.example"]}, "nfs_server_export_clients holds 'head.example', not a network or address: "
                                           "use CIDR form, e.g. 10.10.0.0/24"),
    ({"export_options": ["rw", "sync", "async"]}, "nfs_server_export_options holds both sync and async: keep one "
                                                  "(sync is safe for checkpoints)"),
    ({"export_options": ["root_squash", "no_root_squash"]}, "nfs_server_export_options holds both root_squash and "
                                                            "no_root_squash: keep one (root_squash)"),
    ({"threads": 0}, "nfs_server_threads is 0: use 1 to 1024 (about 4 per client node)"),
    ({"threads": 1025}, "nfs_server_threads is 1025: use 1 to 1024 (about 4 per client node)"),
    ({"threads": "many"}, "nfs_server_threads is many: use 1 to 1024 (about 4 per client node)"),
    ({"threads": -4}, "nfs_server_threads is -4: use 1 to 1024 (about 4 per client node)"),
])
def test_each_problem(changes, problem):
    assert check(**changes) == [problem]


def test_every_client_is_checked_and_problems_add_up():
    found = check(export_path="shared", export_clients=["10.10.0.0/24", "*", "nonsense"], threads=0)
    assert len(found) == 4
    assert found[0].startswith("nfs_server_export_path is 'shared'")
    assert "'*', which exports to everyone" in found[1] and "'nonsense', not a network" in found[2]
    assert found[3].startswith("nfs_server_threads is 0")
