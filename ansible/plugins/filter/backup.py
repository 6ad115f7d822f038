"""The checks of the backup role before it changes anything (main.yml and the restore entry point): each problem
names the variable and the fix; an empty list means fine. Unit-tested in tests/backup/test_backup_filter.py."""
from __future__ import annotations

import re
import runpy
from pathlib import Path

# Filters cannot import module_utils or each other: the repository's Python comes through module_utils/source_tree.py.
_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
values = _load("ansible/plugins/module_utils/values.py")
# Each value read as the playbooks read it (module_utils/values.py).
_text, _int = values.text, values.jinja_int

REPOSITORY_TYPES = ("sftp", "s3", "local")
_SUBSET = re.compile(r"^([0-9]+(\.[0-9]+)?%|[0-9]+/[0-9]+)$")


def _absolute(value):
    return _text(value).startswith("/")


def _repository_problems(settings, hosts):
    kind = _text(settings.get("repository_type"))
    if kind not in REPOSITORY_TYPES:
        return [f"backup_repository_type is '{kind}': use {', '.join(REPOSITORY_TYPES[:-1])} or {REPOSITORY_TYPES[-1]}"]
    problems = []
    if kind == "sftp":
        server = _text(settings.get("sftp_server"))
        if not _text(settings.get("sftp_host")):
            problems.append("backup_sftp_host is empty but backup_repository_type is sftp: set it to the backup host's "
                            "address")
        if not _absolute(settings.get("sftp_path")):
            problems.append(f"backup_sftp_path is '{_text(settings.get('sftp_path'))}': use an absolute path on the "
                            "backup host")
        if server and server not in hosts:
            problems.append(f"backup_sftp_server is '{server}', not a host of the inventory: add the backup host to "
                            "the inventory, or leave it empty and set backup_sftp_host_key")
        elif not server and not _text(settings.get("sftp_host_key")):
            problems.append("backup_sftp_server and backup_sftp_host_key are both empty: name the backup host's "
                            "inventory entry in backup_sftp_server, or give its public host key (ssh-keyscan -t "
                            "ed25519 HOST) in backup_sftp_host_key")
    elif kind == "s3":
        if not _text(settings.get("s3_url")).startswith("s3:"):
            problems.append(f"backup_s3_url is '{_text(settings.get('s3_url'))}': use restic's form "
                            "s3:https://HOST/BUCKET/PREFIX")
        if not (settings.get("s3_access_key_set") and settings.get("s3_secret_key_set")):
            problems.append("backup_s3_access_key_id or backup_s3_secret_access_key is empty: set both (in a vault) "
                            "for the bucket of backup_s3_url")
    elif not _absolute(settings.get("local_path")):
        problems.append(f"backup_local_path is '{_text(settings.get('local_path'))}': use an absolute path")
    return problems


def backup_problems(settings, hosts):
    """`settings`: the role's variables without the backup_ prefix: runner, repository_type, sftp_host, sftp_path,
    sftp_server, sftp_host_key, s3_url, local_path, shared_root, shared_paths, state_paths, check_paths, keep_daily,
    keep_weekly, keep_monthly, check_read_data_subset, restore_path, restore_target; paths (every path a snapshot
    holds); restore (true at the restore entry point); and, for the secrets, only whether each is set:
    restic_password_set, s3_access_key_set, s3_secret_key_set. `hosts`: the inventory's hosts (hostvars)."""
    problems = []
    runner = _text(settings.get("runner"))
    paths = list(settings.get("paths") or [])
    if runner not in hosts:
        problems.append(f"backup_runner is '{runner}', not a host of the inventory: set it to the node that runs the "
                        "backups (default: the head)")
    if not settings.get("restic_password_set"):
        problems.append("backup_restic_password is empty: set it in a vault (openssl rand -base64 48 | ansible-vault "
                        "encrypt_string --name backup_restic_password) and keep a copy off the cluster")
    problems += _repository_problems(settings, hosts)
    if not paths:
        problems.append("backup_shared_paths and backup_state_paths are both empty: list what to back up")
    for path in settings.get("shared_paths") or []:
        if _absolute(path) or ".." in _text(path).split("/") or not _text(path):
            problems.append(f"backup_shared_paths holds '{_text(path)}': give folders relative to backup_shared_root "
                            f"({_text(settings.get('shared_root'))}), without '..'")
    for path in list(settings.get("state_paths") or []) + list(settings.get("check_paths") or []):
        if not _absolute(path):
            problems.append(f"'{_text(path)}' in backup_state_paths or backup_check_paths is not absolute: write the "
                            "full path")
    if sum(_int(settings.get(f"keep_{span}")) for span in ("daily", "weekly", "monthly")) < 1:
        problems.append("backup_keep_daily, backup_keep_weekly and backup_keep_monthly are all 0: restic forget would "
                        "remove every snapshot; keep at least one")
    subset = _text(settings.get("check_read_data_subset"))
    if subset and not _SUBSET.match(subset):
        problems.append(f"backup_check_read_data_subset is '{subset}': use a percentage like 2% or n/t like 1/7, or "
                        "empty to read none")
    if settings.get("restore"):
        restore_path = _text(settings.get("restore_path"))
        target = _text(settings.get("restore_target"))
        if not restore_path.startswith("/"):
            example = f", e.g. -e backup_restore_path={paths[0]}" if paths else ""
            problems.append(f"backup_restore_path is '{restore_path}': give the absolute path as it was backed up"
                            + example)
        if target and not target.startswith("/"):
            problems.append(f"backup_restore_target is '{target}': use an absolute path, or leave it empty to restore "
                            "in place")
    return problems


class FilterModule:
    def filters(self):
        return {"backup_problems": backup_problems}
