"""The AWS file system mounts of ansible/plugins/filter/cloud_fs.py: what systemd mounts, the unit's name
(checked against systemd-escape), and the problems of a client's settings."""

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "ansible" / "plugins" / "filter" / "cloud_fs.py"
spec = importlib.util.spec_from_file_location("cloud_fs_filter", PLUGIN)
cloud_fs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cloud_fs)

FSX = {"dns_name": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com", "mount_name": "abcdefgh"}
EFS = {"dns_name": "fs-0456.efs.us-east-1.amazonaws.com"}


def test_fsx_lustre_mount_is_the_documented_one():
    assert cloud_fs.cloud_fs_mount("fsx_lustre", FSX) == {
        "what": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com@tcp:/abcdefgh", "type": "lustre",
        "options": "relatime,flock,_netdev"}


def test_efs_mount_is_nfs_4_1_with_the_documented_options():
    mount = cloud_fs.cloud_fs_mount("efs", EFS, ["noatime", "_netdev"])
    assert mount["what"] == "fs-0456.efs.us-east-1.amazonaws.com:/" and mount["type"] == "nfs4"
    assert mount["options"] == ("nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport,"
                                "_netdev,noatime")


def test_other_backends_are_not_mounts():
    with pytest.raises(ValueError, match="backend 'glusterfs'"):
        cloud_fs.cloud_fs_mount("glusterfs", FSX)


@pytest.mark.parametrize("path", ["/shared", "/fsx", "/data/shared-vol", "/mnt/a.b", "/srv/x_y:z", "/shared/",
                                  "/mnt/with space", "/mnt/ünï", "/.hidden"])
def test_unit_name_matches_systemd_escape(path):
    escape = shutil.which("systemd-escape")
    if escape is None:
        pytest.skip("systemd-escape is not installed")
    expected = subprocess.run([escape, "--path", "--suffix=mount", path], capture_output=True, text=True,
                              check=True).stdout.strip()
    assert cloud_fs.systemd_mount_unit_name(path) == expected


def test_good_settings_have_no_problem():
    assert cloud_fs.cloud_fs_problems("fsx_lustre", FSX, "/shared") == []
    assert cloud_fs.cloud_fs_problems("efs", EFS, "/shared", ["noatime"]) == []


@pytest.mark.parametrize(("args", "message"), [
    (("fsx_lustre", {"dns_name": FSX["dns_name"]}, "/shared"), "has no mount_name: the fsx_lustre mount needs it"),
    (("fsx_lustre", {}, "/shared"), "has no dns_name"),
    (("efs", None, "/shared"), "has no dns_name"),
    (("efs", {"dns_name": "fs 0456"}, "/shared"), "cloud_fs_client_filesystem.dns_name is 'fs 0456', not a DNS name"),
    (("fsx_lustre", {**FSX, "mount_name": "a/b"}, "/shared"), "mount_name is 'a/b', not a FSx mount name"),
    (("efs", EFS, "shared"), "cloud_fs_client_mount_path is 'shared': give an absolute path"),
    (("efs", EFS, "/"), "cloud_fs_client_mount_path is '/'"),
    (("efs", EFS, "/data/../shared"), "cloud_fs_client_mount_path is '/data/../shared'"),
    (("efs", EFS, "/shared", ["soft"]), "holds soft: a soft mount can return short reads"),
    (("efs", EFS, "/shared", ["noauto"]), "holds noauto"),
    (("efs", EFS, "/shared", [], ["10.0.0.5:/srv/nfs/shared nfs"]),
     "/shared is already mounted or in /etc/fstab from 10.0.0.5:/srv/nfs/shared nfs: one volume per path"),
    (("glusterfs", EFS, "/shared"), "cluster_storage_backend is 'glusterfs': cloud_fs_client mounts fsx_lustre or efs"),
])
def test_bad_settings_are_named(args, message):
    problems = cloud_fs.cloud_fs_problems(*args)
    assert any(message in problem for problem in problems), problems
