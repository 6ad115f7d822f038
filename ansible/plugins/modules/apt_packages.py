#!/usr/bin/python
"""Documentation of the apt_packages action (ansible/plugins/action/apt_packages.py), for ansible-doc and
ansible-lint; the action does the work on the control machine and never runs this file on a node."""
from __future__ import annotations

DOCUMENTATION = r"""
---
module: apt_packages
short_description: Install apt packages in one task, asking apt only for those dpkg does not show as installed
description:
  - Runs C(dpkg-query --show) for the plain names on the node, keeps the names that are not installed
    (and every name that is not a plain package name, such as C(name=version), which only apt can match), and
    runs M(ansible.builtin.apt) for those alone. When everything is installed apt is never started, which
    saves the one or two seconds it spends loading its cache on every host.
  - The probe runs on every run, so a package removed since an earlier run is installed again.
  - Check mode lists what would be installed without asking apt (a source added in the same check run has
    no package lists yet).
options:
  name:
    description: Package names (plain names, or anything M(ansible.builtin.apt) accepts).
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
"""

RETURN = r"""
missing:
  description: The names the probe did not find installed (and names only apt can match), in the order given.
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
