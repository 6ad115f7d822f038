#!/usr/bin/python
"""Documentation of the apt_packages action (ansible/plugins/action/apt_packages.py), for ansible-doc and
ansible-lint; the action does the work on the control machine and never runs this file on a node."""
from __future__ import annotations

DOCUMENTATION = r"""
---
module: apt_packages
short_description: Install apt packages in one task, asking apt only for those dpkg does not show as installed
description:
  - Runs C(dpkg-query --show) on the node for the plain names and the packages of exact pins
    (C(name=version)), keeps the plain names that are not installed, the pins whose package is not installed
    at exactly that version (held or not), and every name only apt can match (wildcards, C(name:arch),
    C(name>=version), a C(.deb) path), and runs M(ansible.builtin.apt) for those alone. When everything is
    installed apt is never started, which saves the one or two seconds it spends loading its cache on every
    host.
  - The probe runs on every run, so a package removed since an earlier run is installed again.
  - Check mode lists what would be installed without asking apt (a source added in the same check run has
    no package lists yet).
options:
  name:
    description: Package names (plain names, C(name=version) pins, or anything M(ansible.builtin.apt)
      accepts). A pin at the installed version leaves the package alone; another version is installed.
    type: list
    elements: str
    required: true
  update_cache:
    description: Refresh apt's lists before installing, when something is missing and they are older
      than O(cache_valid_time). Nothing is refreshed when everything is installed.
    type: bool
    default: true
  cache_valid_time:
    description: Seconds for which apt's lists count as fresh.
    type: int
    default: 3600
  install_recommends:
    description: Install recommended packages too.
    type: bool
    default: false
  allow_change_held_packages:
    description: Let apt change the version of packages on the hold list (passed to M(ansible.builtin.apt)).
      A held package pinned at its installed version is left alone whatever this says; without it, a pin
      to another version of a held package fails.
    type: bool
    default: false
  policy_rc_d:
    description: Exit code of the C(/usr/sbin/policy-rc.d) that M(ansible.builtin.apt) puts in place
      while it installs (C(101) keeps the packages' services from starting), passed to it unchanged. Unset,
      C(/usr/sbin/policy-rc.d) is left as it is.
    type: int
attributes:
  check_mode:
    support: full
author: sd3-cluster developers
"""

EXAMPLES = r"""
- name: Install munge
  apt_packages:
    name: [munge, libmunge2]

- name: Install a pinned NCCL without refreshing the lists
  apt_packages:
    name: ["libnccl2=2.26.2-1+cuda12.8"]
    update_cache: false

- name: Move held driver packages to a new version, starting none of their services
  apt_packages:
    name: ["nvidia-smi=535.261.03-1", "libcuda1=535.261.03-1"]
    allow_change_held_packages: true
    policy_rc_d: 101
"""

RETURN = r"""
missing:
  description: The names the probe did not find installed (a pin, not at that version), and the names only
    apt can match, in the order given.
  type: list
  elements: str
  returned: always
installed:
  description: The names apt installed (in check mode, would install); empty when apt changed nothing.
  type: list
  elements: str
  returned: always
"""

if __name__ == "__main__":
    raise SystemExit("apt_packages runs as an action on the control machine (ansible/plugins/action/).")
