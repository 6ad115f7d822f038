"""The molecule scenarios' connection to their nodes (molecule/_shared/connection_plugins/podman.py): the
driver's `podman` connection with pipelining. Checked on a node of the local cluster, through the plugin path
molecule's config gives: a module runs in one `podman exec --interactive` and its result comes back; a file
copy (which needs a temporary folder on the node) still works; a raw command (no input: no --interactive) and a
module run with become (sudo, as roles do) work too.

Marked `cluster`: needs the nodes of `make cluster-up` (the `e2e` target starts them).
"""
from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from e2e_support import BIN, ENV, REPO, run

pytestmark = pytest.mark.cluster

PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - name: Read the node's name with a module
      ansible.builtin.slurp:
        src: /etc/hostname
      register: name
    - name: Copy a file there
      ansible.builtin.copy:
        content: "{{ name.content | b64decode }}"
        dest: /tmp/sd3-connection-test
        mode: "0600"
    - name: Run a raw command
      ansible.builtin.raw: cat /etc/hostname
      register: raw
      changed_when: false
    - name: Run a module with become
      ansible.builtin.command: id -un
      become: true
      register: become
      changed_when: false
    - name: Report
      ansible.builtin.debug:
        msg: >-
          RESULT name=[{{ name.content | b64decode | trim }}] raw=[{{ raw.stdout | trim }}]
          become=[{{ become.stdout }}]
"""


def test_molecule_connection_pipelines_modules_through_podman_exec(tmp_path):
    config = yaml.safe_load((REPO / ".config" / "molecule" / "config.yml").read_text())
    plugin_path = config["provisioner"]["config_options"]["defaults"]["connection_plugins"]
    plugin_path = plugin_path.replace("${MOLECULE_PROJECT_DIRECTORY}", str(REPO))
    (tmp_path / "play.yml").write_text(PLAY)
    # The inventory molecule's podman driver writes: the container's name, connection `podman`.
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(
        {"all": {"hosts": {"sd3-node1": {"ansible_connection": "podman", "ansible_podman_executable": "podman",
                                         "ansible_python_interpreter": "/usr/bin/python3"}}}}))
    result = subprocess.run([str(BIN / "ansible-playbook"), "-vvv", "-i", str(tmp_path / "inventory.yml"),
                             str(tmp_path / "play.yml")], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=dict(ENV, ANSIBLE_CONNECTION_PLUGINS=plugin_path), check=False)
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-2000:]
    slurp = out.split("TASK [Read the node's name with a module]")[1].split("TASK [")[0]
    execs = re.findall(r"RUN \[(.*?)\]", slurp)
    exec_calls = [call for call in execs if "b'exec'" in call]
    assert len(exec_calls) == 1, f"one podman exec for a pipelined module, got {len(exec_calls)}:\n{slurp}"
    assert "b'--interactive'" in exec_calls[0]
    assert "ansible-tmp-" not in slurp, "a pipelined module needs no temporary folder on the node"
    # The collection's connection never passes --interactive, so the line above also shows that molecule's
    # plugin path gives ours. The module's result came back through the pipe.
    assert re.search(r"RESULT name=\[(.*?)\] raw=\[(.*?)\] become=\[(.*?)\]", out).groups() == \
        ("node1", "node1", "root")
    raw = out.split("TASK [Run a raw command]")[1].split("TASK [")[0]
    assert "b'--interactive'" not in raw, "a command without input must not hold podman's stdin open"
    become = out.split("TASK [Run a module with become]")[1].split("TASK [")[0]
    assert "b'--interactive'" in become and "sudo" in become, "become with sudo runs pipelined too"
    copy = out.split("TASK [Copy a file there]")[1].split("TASK [")[0]
    assert "changed: [sd3-node1]" in copy or "ok: [sd3-node1]" in copy
    assert run("podman", "exec", "sd3-node1", "cat", "/tmp/sd3-connection-test").stdout.strip() == "node1"
    run("podman", "exec", "sd3-node1", "rm", "-f", "/tmp/sd3-connection-test")
