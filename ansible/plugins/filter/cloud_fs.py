"""The AWS shared file systems as mounts: what systemd mounts (FSx for Lustre, EFS over NFS 4.1) and the
problems of a client's settings. Used by the cloud_fs_client role; unit-tested in tests/storage."""

from __future__ import annotations

import re
from collections.abc import Mapping

# FSx for Lustre's mount, as AWS documents it: relatime (atime in memory, written rarely) and flock (locks
# coherent across clients; training code and tools lock files on the shared volume).
LUSTRE_OPTIONS = ("relatime", "flock")
# EFS without efs-utils, as AWS documents it: NFS 4.1, 1 MiB transfers, hard mounts with 60 s timeouts and two
# tries, and noresvport (a new source port on reconnect, so a network blip does not hang the mount).
EFS_OPTIONS = ("nfsvers=4.1", "rsize=1048576", "wsize=1048576", "hard", "timeo=600", "retrans=2", "noresvport")
# Both need the network: systemd orders a mount with _netdev after network-online.target, before remote-fs.
NETWORK_OPTION = "_netdev"
BACKENDS = {"fsx_lustre": ("lustre", ("dns_name", "mount_name")), "efs": ("nfs4", ("dns_name",))}
_DNS_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
_MOUNT_NAME = re.compile(r"^[A-Za-z0-9_]{1,16}$")
_UNSAFE_OPTIONS = {"soft": "a soft mount can return short reads and lose checkpoint writes; use hard",
                   "noauto": "the unit is the mount: noauto would leave it unmounted at boot"}


def systemd_mount_unit_name(path):
    """The unit name systemd requires for a mount at `path` (what `systemd-escape --path --suffix=mount` prints)."""
    trimmed = re.sub(r"/+", "/", str(path)).strip("/")
    if not trimmed:
        return "-.mount"
    out = []
    for index, char in enumerate(trimmed):
        if char == "/":
            out.append("-")
        elif char.isascii() and (char.isalnum() or char in ":_" or (char == "." and index > 0)):
            out.append(char)
        else:
            out.extend(f"\\x{byte:02x}" for byte in char.encode())
    return "".join(out) + ".mount"


def cloud_fs_mount(backend, filesystem, extra_options=()):
    """{what, type, options} of the systemd mount of `backend` ('fsx_lustre' or 'efs') for the file system
    {dns_name, mount_name}; extra_options are appended (a later one of the same name wins at mount time)."""
    filesystem = filesystem if isinstance(filesystem, Mapping) else {}
    dns_name = str(filesystem.get("dns_name", "")).strip()
    if backend == "fsx_lustre":
        mount_name = str(filesystem.get("mount_name", "")).strip()
        what, fstype, base = f"{dns_name}@tcp:/{mount_name}", "lustre", LUSTRE_OPTIONS
    elif backend == "efs":
        what, fstype, base = f"{dns_name}:/", "nfs4", EFS_OPTIONS
    else:
        raise ValueError(f"cloud_fs_mount: backend '{backend}' is none of {', '.join(BACKENDS)}")
    options = [*base, NETWORK_OPTION, *(str(option) for option in extra_options or ())]
    return {"what": what, "type": fstype, "options": ",".join(dict.fromkeys(options))}


def cloud_fs_problems(backend, filesystem, mount_path, extra_options=(), other_mounts=()):
    """The problems of a client's settings, each naming the variable and the fix (empty: fine).

    other_mounts: fstab lines or live mounts at mount_path that are not this role's unit ('SOURCE TYPE')."""
    problems = []
    if backend not in BACKENDS:
        return [f"cluster_storage_backend is '{backend}': cloud_fs_client mounts {' or '.join(BACKENDS)} only; "
                "site.yml runs it for those backends alone"]
    filesystem = filesystem if isinstance(filesystem, Mapping) else {}
    for key in BACKENDS[backend][1]:
        value = str(filesystem.get(key) or "").strip()
        pattern = _DNS_NAME if key == "dns_name" else _MOUNT_NAME
        if not value:
            problems.append(f"cloud_fs_client_filesystem (cluster_shared_filesystem) has no {key}: the {backend} "
                            "mount needs it; pulumi/aws sets it, or give the file system's own")
        elif not pattern.match(value):
            problems.append(f"cloud_fs_client_filesystem.{key} is '{value}', not a "
                            f"{'DNS name' if key == 'dns_name' else 'FSx mount name (letters, digits, _)'}")
    path = str(mount_path)
    if not path.startswith("/") or path.rstrip("/") == "" or "/../" in f"{path}/" or "//" in path:
        problems.append(f"cloud_fs_client_mount_path is '{path}': give an absolute path below /, e.g. /shared")
    for option in extra_options or ():
        reason = _UNSAFE_OPTIONS.get(str(option).split("=")[0])
        if reason:
            problems.append(f"cloud_fs_client_extra_options holds {option}: {reason}")
    for other in other_mounts or ():
        problems.append(f"{path} is already mounted or in /etc/fstab from {other}: one volume per path; remove that "
                        "line (or unmount it) so the shared volume is mounted once, by this role's unit")
    return problems


class FilterModule:
    def filters(self):
        return {"cloud_fs_mount": cloud_fs_mount, "cloud_fs_problems": cloud_fs_problems,
                "systemd_mount_unit_name": systemd_mount_unit_name}
