"""The checks of the storage client roles (ansible/plugins/filter/storage_clients.py): good settings pass,
each bad one gets its message."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "ansible" / "plugins" / "filter" / "storage_clients.py"
spec = importlib.util.spec_from_file_location("storage_clients_under_test", PATH)
clients = importlib.util.module_from_spec(spec)
spec.loader.exec_module(clients)
filters = clients.FilterModule().filters()
GROUP = {"name": "sd3", "gid": 2000}


def gluster(**overrides):
    values = {"servers": ["10.0.0.1"], "mount_path": "/shared", "group": GROUP,
              "mount_options": ["defaults", "_netdev"]}
    values.update(overrides)
    return filters["glusterfs_client_problems"](values.pop("servers"), **values)


def nfs(**overrides):
    values = {"server": "10.0.0.1", "export_path": "/srv/shared", "mount_path": "/shared",
              "mount_options": ["hard", "vers=4.2"], "group": GROUP}
    values.update(overrides)
    return filters["nfs_client_problems"](values.pop("server"), **values)


def test_good_settings_have_no_problem():
    assert gluster() == [] and nfs() == []
    assert gluster(group={"name": "sd3", "gid": "2000"}) == []


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"servers": []}, "glusterfs_client_servers is empty (default: the addresses of storage_nodes): put the GlusterFS "
                      "servers in storage_nodes"),
    ({"mount_path": "shared"}, "glusterfs_client_mount_path (cluster_shared_path) is 'shared': use an absolute path "
                               "such as /shared"),
    ({"group": {"name": "sd3"}}, "glusterfs_client_group (cluster_group) is {'name': 'sd3'}: give it a name and a "
                                 "numeric gid, e.g. {name: sd3, gid: 2000}"),
    ({"group": {"name": "sd3", "gid": "x"}}, "glusterfs_client_group (cluster_group) is {'name': 'sd3', 'gid': 'x'}: "
                                             "give it a name and a numeric gid, e.g. {name: sd3, gid: 2000}"),
    ({"mount_options": ["backup-volfile-servers=a:b"]},
     "glusterfs_client_mount_options sets backup-volfile-servers itself: remove it, the role adds it from "
     "glusterfs_client_servers"),
])
def test_each_glusterfs_client_problem(overrides, problem):
    assert gluster(**overrides) == [problem]


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"server": ""}, "nfs_client_server is empty (default: the head's address): put one host in the head group"),
    ({"export_path": "srv"}, "nfs_client_export_path is 'srv': use an absolute path"),
    ({"mount_path": "shared"}, "nfs_client_mount_path is 'shared': use an absolute path"),
    ({"mount_options": ["soft"]}, "nfs_client_mount_options holds soft: a soft mount can return short reads and lose "
                                  "checkpoint writes; use hard"),
    ({"group": "sd3"}, "nfs_client_group (cluster_group) is sd3: give it a name and a numeric gid, e.g. "
                       "{name: sd3, gid: 2000}"),
])
def test_each_nfs_client_problem(overrides, problem):
    assert nfs(**overrides) == [problem]
