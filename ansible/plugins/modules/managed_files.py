#!/usr/bin/python
"""Ansible module: write (or remove) a list of small files in one call, each only when it differs."""
from __future__ import annotations

import grp
import os
import pwd
import stat
import tempfile

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: managed_files
short_description: Keep several files at a given content, mode and owner in one module call
description:
  - Does what a loop of M(ansible.builtin.copy) with C(content) (or M(ansible.builtin.file) with C(state=absent))
    does, in one module call per host instead of one per file. On a loaded control node each call costs
    about half a second, so roles write their groups of units, scripts and dashboards with this module.
  - Templating stays on the controller; pass C(content) from C(lookup('ansible.builtin.template', ...)) or
    C(lookup('ansible.builtin.file', ..., rstrip=false)).
  - A file is rewritten only when its bytes differ, and then atomically (a temporary file in the same folder,
    given its mode and owner before it is renamed over the old one). Mode and owner alone are fixed in place.
  - A symbolic link at a path is replaced by a regular file, as M(ansible.builtin.copy) does by default.
  - Supports check mode and C(--diff) (one diff per changed file).
options:
  files:
    description: The files, in the order they are handled.
    type: list
    elements: dict
    required: true
    suboptions:
      path:
        description: Absolute path of the file; its folder must exist.
        type: path
        required: true
      state:
        description: C(present) writes the file; C(absent) removes it when it is there.
        type: str
        choices: [present, absent]
        default: present
      content:
        description: The whole text of the file (required with C(state=present)).
        type: str
      mode:
        description: Octal mode such as C("0644"); default the top-level C(mode).
        type: raw
      owner:
        description: User name or uid; default the top-level C(owner).
        type: str
      group:
        description: Group name or gid; default the top-level C(group).
        type: str
  mode:
    description: Mode of files that name none; unset keeps an existing file's mode (new files get 0644 less the umask).
    type: raw
  owner:
    description: Owner of files that name none; unset keeps an existing file's owner (new files belong to the caller).
    type: str
  group:
    description: Group of files that name none; unset keeps an existing file's group.
    type: str
author: sd3-cluster developers
"""

EXAMPLES = r"""
- name: Install the collector scripts
  managed_files:
    owner: root
    group: root
    mode: "0755"
    files:
      - path: /usr/local/lib/sd3/collect.py
        content: "{{ lookup('ansible.builtin.file', 'collect.py', rstrip=false) }}"
      - path: /etc/systemd/system/sd3-collect.service
        content: "{{ lookup('ansible.builtin.template', 'collect.service.j2') }}"
        mode: "0644"
      - path: /etc/systemd/system/sd3-old.timer
        state: absent
"""

RETURN = r"""
changed_paths:
  description: Paths that were written, fixed or removed (or would be, in check mode), in the order given.
  type: list
  elements: str
  returned: always
"""


class FilesError(Exception):
    """A file of the list cannot be handled as asked; the message names it and says why."""


def parse_mode(mode, path):
    """An octal mode string or int as an int; None stays None."""
    if mode is None or mode == "":
        return None
    if isinstance(mode, int):
        # YAML reads an unquoted 0644 as the int 420: take it as the mode it meant.
        value = mode
    else:
        text = str(mode).strip()
        try:
            value = int(text, 8)
        except ValueError:
            raise FilesError(f"{path}: mode {mode!r} is not an octal mode; write it quoted, such as \"0644\"") from None
    if not 0 <= value <= 0o7777:
        raise FilesError(f"{path}: mode {mode!r} is out of range (0000 to 7777)")
    return value


def resolve_id(name, lookup, field):
    """The numeric id of a user or group name (or of a number given as text); None when it does not exist here.
    lookup is pwd.getpwnam or grp.getgrnam, field the id's attribute in its answer."""
    if name is None:
        return None
    try:
        return getattr(lookup(name), field)
    except KeyError:
        return int(name) if name.isdigit() else None


def normalise(entry, defaults):
    """One file's wanted state with the top-level defaults filled in; FilesError on a bad entry."""
    path = entry["path"]
    if not os.path.isabs(path):
        raise FilesError(f"{path}: give an absolute path")
    state = entry.get("state") or "present"
    if state == "present" and entry.get("content") is None:
        raise FilesError(f"{path}: state=present needs content")
    return {
        "path": path,
        "state": state,
        "content": entry.get("content"),
        "mode": parse_mode(entry.get("mode") if entry.get("mode") is not None else defaults.get("mode"), path),
        "owner": entry.get("owner") if entry.get("owner") is not None else defaults.get("owner"),
        "group": entry.get("group") if entry.get("group") is not None else defaults.get("group"),
    }


def read_current(path):
    """(lstat result or None, bytes of a regular file or None)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, None
    except NotADirectoryError:
        # A file where a folder of the path should be is a different mistake from a missing folder: say which.
        folder = os.path.dirname(path)
        while folder != "/" and not os.path.isdir(os.path.dirname(folder)):
            folder = os.path.dirname(folder)
        raise FilesError(f"{path}: {folder} is not a folder (a file is there); move it away or choose another "
                         "path") from None
    if stat.S_ISDIR(st.st_mode):
        raise FilesError(f"{path}: is a folder, not a file; remove it or choose another path")
    if not stat.S_ISREG(st.st_mode):
        return st, None
    with open(path, "rb") as handle:
        return st, handle.read()


def plan_file(want, current_stat, current_bytes, uid, gid):
    """What to do for one present file: (write content?, list of attribute changes as (name, before, after))."""
    data = want["content"].encode("utf-8")
    rewrite = current_bytes is None or current_bytes != data
    if current_stat is None or not stat.S_ISREG(current_stat.st_mode):
        return True, []
    changes = []
    if want["mode"] is not None and stat.S_IMODE(current_stat.st_mode) != want["mode"]:
        changes.append(("mode", f"{stat.S_IMODE(current_stat.st_mode):04o}", f"{want['mode']:04o}"))
    if want["owner"] is not None and current_stat.st_uid != uid:
        changes.append(("owner", str(current_stat.st_uid), want["owner"]))
    if want["group"] is not None and current_stat.st_gid != gid:
        changes.append(("group", str(current_stat.st_gid), want["group"]))
    return rewrite, changes


def write_atomically(path, data, mode, uid, gid, current_stat):
    """Write data to a temporary file beside path, give it its final mode and owner, rename it over path."""
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise FilesError(f"{path}: the folder {folder} does not exist; create it first")
    if mode is None:
        if current_stat is not None and stat.S_ISREG(current_stat.st_mode):
            mode = stat.S_IMODE(current_stat.st_mode)
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o644 & ~umask
    if current_stat is not None and stat.S_ISREG(current_stat.st_mode):
        uid = current_stat.st_uid if uid is None else uid
        gid = current_stat.st_gid if gid is None else gid
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
            os.fchmod(handle.fileno(), mode)
            if uid is not None or gid is not None:
                os.fchown(handle.fileno(), -1 if uid is None else uid, -1 if gid is None else gid)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def converge(module, entries, defaults):
    """Handle every file; return (changed paths, diffs, warnings)."""
    changed_paths, diffs, warnings = [], [], []
    for entry in entries:
        want = normalise(entry, defaults)
        path = want["path"]
        current_stat, current_bytes = read_current(path)
        if want["state"] == "absent":
            if current_stat is not None:
                changed_paths.append(path)
                diffs.append({"before_header": path, "after_header": path,
                              "before": {"path": path, "state": "file"}, "after": {"path": path, "state": "absent"}})
                if not module.check_mode:
                    os.unlink(path)
            continue
        uid = resolve_id(want["owner"], pwd.getpwnam, "pw_uid")
        gid = resolve_id(want["group"], grp.getgrnam, "gr_gid")
        for name, value, resolved in (("owner", want["owner"], uid), ("group", want["group"], gid)):
            if value is not None and resolved is None:
                # In check mode the user may be one that an earlier task of this run would have made.
                if not module.check_mode:
                    raise FilesError(f"{path}: {name} {value!r} does not exist on this host; create it first")
                warnings.append(f"{path}: {name} {value!r} does not exist yet (check mode)")
        rewrite, changes = plan_file(want, current_stat, current_bytes, uid, gid)
        if not rewrite and not changes:
            continue
        changed_paths.append(path)
        if rewrite:
            before = current_bytes.decode("utf-8", "replace") if current_bytes is not None else ""
            diffs.append({"before_header": path if current_stat is not None else "/dev/null", "after_header": path,
                          "before": before, "after": want["content"]})
        if changes:
            header = f"{path} (attributes)"
            diffs.append({"before_header": header, "after_header": header,
                          "before": {name: old for name, old, _ in changes},
                          "after": {name: new for name, _, new in changes}})
        if module.check_mode:
            continue
        if rewrite:
            write_atomically(path, want["content"].encode("utf-8"), want["mode"], uid, gid, current_stat)
        else:
            if want["mode"] is not None:
                os.chmod(path, want["mode"])
            if any(name in ("owner", "group") for name, _, _ in changes):
                os.lchown(path, -1 if want["owner"] is None else uid, -1 if want["group"] is None else gid)
    return changed_paths, diffs, warnings


def main():
    file_options = dict(
        path=dict(type="path", required=True),
        state=dict(type="str", choices=["present", "absent"], default="present"),
        content=dict(type="str"),
        mode=dict(type="raw"),
        owner=dict(type="str"),
        group=dict(type="str"),
    )
    module = AnsibleModule(
        argument_spec=dict(
            files=dict(type="list", elements="dict", required=True, options=file_options),
            mode=dict(type="raw"),
            owner=dict(type="str"),
            group=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    defaults = {name: module.params[name] for name in ("mode", "owner", "group")}
    try:
        changed_paths, diffs, warnings = converge(module, module.params["files"], defaults)
    except FilesError as err:
        module.fail_json(msg=str(err))
    except OSError as err:
        module.fail_json(msg=f"{err.filename or ''}: {err.strerror}; check the folder's permissions and free space")
    for warning in warnings:
        module.warn(warning)
    result = {"changed": bool(changed_paths), "changed_paths": changed_paths}
    if module._diff:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
