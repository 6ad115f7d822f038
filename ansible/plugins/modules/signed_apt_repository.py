#!/usr/bin/python
"""Documentation of the signed_apt_repository action (ansible/plugins/action/signed_apt_repository.py), for
ansible-doc and ansible-lint; the action does the work on the control machine and never runs this file."""
from __future__ import annotations

DOCUMENTATION = r"""
---
module: signed_apt_repository
short_description: Add a vendor's apt repository, trusted through its own key once the key's fingerprint is checked
description:
  - Gets the key (downloaded on the node from O(key_url), or copied from O(key_src) on the control machine),
    reads its fingerprints on the control machine and stops, before anything is written, unless
    O(key_fingerprint) is among them. The message names the repository, the fingerprint expected and the
    ones found.
  - Keeps the key ASCII-armored at O(key_path) and writes C(/etc/apt/sources.list.d/NAME.sources) (deb822)
    with C(Signed-By) naming that key alone; refreshes apt's lists only when one of the two files changed.
  - A key already at O(key_path) is not downloaded again; its fingerprint is still checked on every run.
    Delete the file to fetch a rotated key.
  - Check mode and C(--diff) are supported; in check mode a key that is not on the node yet is not
    downloaded, so its fingerprint is checked on the real run.
options:
  name:
    description: File stem of the source and of the default key, e.g. C(cuda).
    type: str
    required: true
  key_url:
    description: URL of the repository's public key, downloaded on the node. Give this or O(key_src).
    type: str
  key_src:
    description: The key as a file on the control machine (air-gapped sites, tests), searched like the
      C(src) of M(ansible.builtin.copy). Give this or O(key_url).
    type: str
  key_fingerprint:
    description: The key's full fingerprint (40 hexadecimal digits; spaces and case do not matter).
      A primary key's or a subkey's fingerprint is accepted.
    type: str
    required: true
  uris:
    description: Repository URLs.
    type: list
    elements: str
    required: true
  suites:
    description: Suites, e.g. C(bookworm), or C(/) for a flat repository.
    type: list
    elements: str
    required: true
  components:
    description: Components, e.g. C(main); empty for a flat repository (suite ending in C(/)).
    type: list
    elements: str
    default: []
  architectures:
    description: Architectures to fetch; empty means apt's default.
    type: list
    elements: str
    default: []
  key_path:
    description: Where the key is kept; must end in C(.asc). Empty means C(/etc/apt/keyrings/NAME.asc).
    type: str
    default: ""
  update_cache:
    description: Refresh apt's lists when the key or the source changed (false only where the repository
      cannot be reached, such as tests that check the files alone).
    type: bool
    default: true
  state:
    description: C(absent) removes the source and the key (and refreshes the lists when they were there).
    type: str
    choices: [present, absent]
    default: present
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
author: sd3-cluster developers
"""

EXAMPLES = r"""
- name: Add Docker's repository
  signed_apt_repository:
    name: docker
    key_url: https://download.docker.com/linux/debian/gpg
    key_fingerprint: 9DC858229FC7DD38854AE2D88D81803C0EBFCD88
    uris: [https://download.docker.com/linux/debian]
    suites: [bookworm]
    components: [stable]
    architectures: [amd64]

- name: Add NVIDIA's CUDA repository (flat)
  signed_apt_repository:
    name: nvidia-cuda
    key_url: https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/3bf863cc.pub
    key_fingerprint: EB693B3035CD5710E231E123A4B469963BF863CC
    uris: [https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/]
    suites: [/]
"""

RETURN = r"""
key_path:
  description: Where the key is kept.
  type: str
  returned: always
sources_path:
  description: The deb822 source file.
  type: str
  returned: always
fingerprints:
  description: Fingerprints found in the key (primary key and subkeys).
  type: list
  elements: str
  returned: when the key was read
changed_paths:
  description: The files written or removed (or that would be, in check mode).
  type: list
  elements: str
  returned: when files were handled
"""

if __name__ == "__main__":
    raise SystemExit("signed_apt_repository runs as an action on the control machine (ansible/plugins/action/).")
