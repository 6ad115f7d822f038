"""The checks of the backup role (ansible/plugins/filter/backup.py): good settings of each repository type pass,
each bad one gets its message naming the variable and the fix."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "ansible" / "plugins" / "filter" / "backup.py"
spec = importlib.util.spec_from_file_location("backup_filter_under_test", PATH)
backup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(backup)
problems = backup.FilterModule().filters()["backup_problems"]

HOSTS = {"head": {}, "backup1": {}}
GOOD = {"runner": "head", "repository_type": "sftp", "sftp_host": "10.10.0.9", "sftp_path": "/srv/restic",
        "sftp_server": "backup1", "sftp_host_key": "", "s3_url": "", "local_path": "/var/backups/restic",
        "shared_root": "/shared", "shared_paths": ["checkpoints", "runs"], "state_paths": ["/etc/slurm"],
        "check_paths": ["/etc/slurm/slurm.conf"], "paths": ["/shared/checkpoints", "/shared/runs", "/etc/slurm"],
        "keep_daily": 7, "keep_weekly": 4, "keep_monthly": 6, "check_read_data_subset": "2%", "restore": False,
        "restore_path": "", "restore_target": "", "restic_password_set": True, "s3_access_key_set": False,
        "s3_secret_key_set": False}
S3 = {"repository_type": "s3", "s3_url": "s3:https://s3.example/bucket/sd3", "s3_access_key_set": True,
      "s3_secret_key_set": True}


def check(hosts=HOSTS, **changes):
    return problems({**GOOD, **changes}, hosts)


def test_good_settings_have_no_problem():
    assert check() == []
    assert check(sftp_server="", sftp_host_key="ssh-ed25519 AAAA") == []
    assert check(**S3) == []
    assert check(repository_type="local", sftp_host="", sftp_path="") == []
    assert check(keep_daily=0, keep_weekly="0", keep_monthly=1, check_read_data_subset="1/7") == []
    assert check(check_read_data_subset="", restore=True, restore_path="/shared/runs/a", restore_target="/tmp/r") == []
    # The hosts may be any container that answers `in`, as Ansible's hostvars does.
    assert check(hosts=["head", "backup1"]) == []


@pytest.mark.parametrize(("changes", "problem"), [
    ({"runner": "nowhere"}, "backup_runner is 'nowhere', not a host of the inventory: set it to the node that runs "
                            "the backups (default: the head)"),
    ({"restic_password_set": False}, "backup_restic_password is empty: set it in a vault (openssl rand -base64 48 | "
                                     "ansible-vault encrypt_string --name backup_restic_password) and keep a copy off "
                                     "the cluster"),
    ({"repository_type": "ftp"}, "backup_repository_type is 'ftp': use sftp, s3 or local"),
    ({"sftp_host": ""}, "backup_sftp_host is empty but backup_repository_type is sftp: set it to the backup host's "
                        "address"),
    ({"sftp_path": "restic"}, "backup_sftp_path is 'restic': use an absolute path on the backup host"),
    ({"sftp_server": "backup9"}, "backup_sftp_server is 'backup9', not a host of the inventory: add the backup host "
                                 "to the inventory, or leave it empty and set backup_sftp_host_key"),
    ({"sftp_server": ""}, "backup_sftp_server and backup_sftp_host_key are both empty: name the backup host's "
                          "inventory entry in backup_sftp_server, or give its public host key (ssh-keyscan -t "
                          "ed25519 HOST) in backup_sftp_host_key"),
    ({**S3, "s3_url": "https://s3.example/bucket"}, "backup_s3_url is 'https://s3.example/bucket': use restic's form "
                                                    "s3:https://HOST/BUCKET/PREFIX"),
    ({**S3, "s3_secret_key_set": False}, "backup_s3_access_key_id or backup_s3_secret_access_key is empty: set both "
                                         "(in a vault) for the bucket of backup_s3_url"),
    ({"repository_type": "local", "local_path": "backups"}, "backup_local_path is 'backups': use an absolute path"),
    ({"shared_paths": ["/shared/x"]}, "backup_shared_paths holds '/shared/x': give folders relative to "
                                      "backup_shared_root (/shared), without '..'"),
    ({"shared_paths": ["runs/../.."]}, "backup_shared_paths holds 'runs/../..': give folders relative to "
                                       "backup_shared_root (/shared), without '..'"),
    ({"shared_paths": [""]}, "backup_shared_paths holds '': give folders relative to backup_shared_root (/shared), "
                             "without '..'"),
    ({"state_paths": ["etc/slurm"]}, "'etc/slurm' in backup_state_paths or backup_check_paths is not absolute: write "
                                     "the full path"),
    ({"check_paths": ["slurm.conf"]}, "'slurm.conf' in backup_state_paths or backup_check_paths is not absolute: "
                                      "write the full path"),
    ({"keep_daily": 0, "keep_weekly": "0", "keep_monthly": "none"},
     "backup_keep_daily, backup_keep_weekly and backup_keep_monthly are all 0: restic forget would remove every "
     "snapshot; keep at least one"),
    ({"check_read_data_subset": "2 percent"}, "backup_check_read_data_subset is '2 percent': use a percentage like 2% "
                                              "or n/t like 1/7, or empty to read none"),
    ({"restore": True, "restore_path": "runs/a"}, "backup_restore_path is 'runs/a': give the absolute path as it was "
                                                  "backed up, e.g. -e backup_restore_path=/shared/checkpoints"),
    ({"restore": True, "restore_path": "/shared/runs", "restore_target": "here"},
     "backup_restore_target is 'here': use an absolute path, or leave it empty to restore in place"),
])
def test_each_problem(changes, problem):
    assert check(**changes) == [problem]


def test_only_the_chosen_repository_type_is_checked():
    # sftp settings are not read for s3 and local, s3 settings not for sftp.
    assert check(**S3, sftp_host="", sftp_path="x", sftp_server="nowhere") == []
    assert check(repository_type="local", s3_url="nonsense", sftp_host="") == []


def test_restore_settings_are_checked_only_at_the_restore_entry_point():
    assert check(restore_path="relative", restore_target="relative") == []
    assert len(check(restore=True, restore_path="relative", restore_target="relative")) == 2


def test_nothing_to_back_up():
    found = check(shared_paths=[], state_paths=[], check_paths=[], paths=[], restore=True, restore_path="x")
    assert found == ["backup_shared_paths and backup_state_paths are both empty: list what to back up",
                     "backup_restore_path is 'x': give the absolute path as it was backed up"]
