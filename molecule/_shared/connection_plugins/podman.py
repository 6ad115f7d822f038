# The molecule scenarios' connection to their podman nodes: containers.podman's `podman` connection with
# pipelining. Molecule's podman driver names the connection `podman` in every instance's inventory entry,
# so this plugin takes that name (molecule's config puts this folder on the connection plugin path, where
# a plugin of the same short name wins over the collection's redirect).
#
# Why: without pipelining every module run is four `podman exec` calls (make a temporary folder, make the
# module copied there through the container's mounted filesystem executable, run it, remove the folder);
# with it, one call that feeds the module to the node's Python on stdin. The collection leaves pipelining
# off because it calls `podman exec` without --interactive, and podman only passes stdin through with it.
# On this project's 2-core CI machine a run of 10 small tasks on 3 nodes took 16 s of wall time and 11 s of
# controller CPU before, 9 s and 6 s with this. The nodes of the real cluster are reached over SSH, where
# ansible.cfg turns pipelining on too, so the scenarios now run modules the way production runs them.
from __future__ import annotations

import shlex

from ansible.module_utils.common.text.converters import to_native
from ansible.plugins.connection import ConnectionBase, ensure_connect
from ansible_collections.containers.podman.plugins.connection.podman import Connection as CollectionConnection

DOCUMENTATION = """
    name: podman
    short_description: Run tasks in a podman container, modules fed on stdin (pipelining)
    description:
      - containers.podman's podman connection, with pipelining (podman exec --interactive when there is
        input).
    options:
      remote_addr:
        description: The container's name or ID.
        default: inventory_hostname
        vars:
          - name: ansible_host
          - name: inventory_hostname
          - name: ansible_podman_host
      remote_user:
        description: The user (name or UID) commands run as inside the container; empty for the image's.
        ini:
          - section: defaults
            key: remote_user
        env:
          - name: ANSIBLE_REMOTE_USER
        vars:
          - name: ansible_user
      podman_extra_args:
        description: Arguments given to podman before its subcommand.
        default: ''
        ini:
          - section: defaults
            key: podman_extra_args
        vars:
          - name: ansible_podman_extra_args
        env:
          - name: ANSIBLE_PODMAN_EXTRA_ARGS
      podman_executable:
        description: The podman program.
        default: podman
        vars:
          - name: ansible_podman_executable
        env:
          - name: ANSIBLE_PODMAN_EXECUTABLE
      pipelining:
        description: Feed modules to the node's Python on stdin instead of copying them there first.
        type: boolean
        default: true
        ini:
          - section: connection
            key: pipelining
        env:
          - name: ANSIBLE_PIPELINING
        vars:
          - name: ansible_pipelining
"""


class Connection(CollectionConnection):
    has_pipelining = True

    @ensure_connect
    def exec_command(self, cmd, in_data=None, sudoable=False):
        ConnectionBase.exec_command(self, cmd, in_data=in_data, sudoable=sudoable)
        # podman exec hands its stdin to the command only with --interactive; without input it stays off, so a
        # command that reads stdin sees it closed, as before.
        args = ["exec", *(["--interactive"] if in_data is not None else [])]
        if self.user:
            args += ["--user", self.user]
        return self._podman(args, shlex.split(to_native(cmd, errors="surrogate_or_strict")), in_data)
