"""The Ansible inventory made from pulumi/aws outputs: the pure function, and inventories/cloud with Ansible."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from sd3_aws.config import parse_config
from sd3_aws.inventory import HostRecord, build_inventory
from sd3_aws.stack import build
from sd3_pulumi_testing import AWS_VALUES, REPO, declare

SCRIPT = REPO / "inventories" / "cloud" / "pulumi_inventory.py"
ANSIBLE_BIN = REPO / ".venv" / "bin"


def test_build_inventory_refuses_a_head_without_public_address():
    head = HostRecord(name="h", private_ip="10.0.0.5", public_key="ssh-ed25519 AAAA")
    with pytest.raises(ValueError, match="only SSH entry"):
        build_inventory(cluster_name="c", network_cidr="10.0.0.0/16", ssh_user="ubuntu", head=head, gpu_nodes=[])


def _saved_outputs(tmp_path, **settings):
    """`pulumi stack output --json` of a mocked stack, saved as a user would save it."""
    config = parse_config({**AWS_VALUES, "gpuNodeCount": 4, **settings})
    outputs = declare(lambda: __import__("pulumi").Output.all(**build(config)))
    path = tmp_path / "outputs.json"
    path.write_text(json.dumps(outputs))
    return path


@pytest.fixture
def saved_outputs(pulumi_mocks, tmp_path):
    return _saved_outputs(tmp_path)


def _ansible_env(outputs_path) -> dict[str, str]:
    env = dict(os.environ, SD3_PULUMI_OUTPUTS=str(outputs_path), ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
               ANSIBLE_FACT_CACHING="memory", SD3_KNOWN_HOSTS=str(outputs_path.parent / "known_hosts"))
    env["PATH"] = f"{ANSIBLE_BIN}:{env['PATH']}"
    return env


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO, timeout=120, check=False)


def test_ansible_inventory_lists_the_groups(saved_outputs):
    done = _run([str(ANSIBLE_BIN / "ansible-inventory"), "-i", str(SCRIPT), "--list"], _ansible_env(saved_outputs))
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert listed["head"]["hosts"] == ["sd3-head"]
    assert listed["gpu_nodes"]["hosts"] == ["sd3-gpu-01", "sd3-gpu-02", "sd3-gpu-03", "sd3-gpu-04"]
    assert listed.get("storage_nodes", {}).get("hosts", []) == []
    hostvars = listed["_meta"]["hostvars"]
    assert set(hostvars) == {"sd3-head", "sd3-gpu-01", "sd3-gpu-02", "sd3-gpu-03", "sd3-gpu-04"}
    assert "ProxyCommand" in hostvars["sd3-gpu-01"]["ansible_ssh_common_args"]
    assert hostvars["sd3-head"]["ansible_host"] != hostvars["sd3-head"]["cluster_address"]


def test_group_vars_resolve_to_the_stack_values(saved_outputs):
    """The inventory directory (script + group_vars/all.yml) gives the project's cluster_* variables."""
    message = ("{{ cluster_name }}|{{ cluster_network_cidr }}|{{ cluster_mtu }}|{{ cluster_storage_backend }}|"
               "{{ cluster_shared_filesystem.mount_name }}|{{ efa_interfaces }}|{{ cluster_address }}")
    done = _run([str(ANSIBLE_BIN / "ansible"), "-i", str(REPO / "inventories" / "cloud"), "sd3-gpu-02", "-o",
                 "-m", "ansible.builtin.debug", "-a", f"msg={message}"], _ansible_env(saved_outputs))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sd3|10.42.0.0/16|9001|fsx_lustre|abcdefgh|32|10.42.128." in done.stdout


def test_script_explains_a_missing_inventory(tmp_path):
    path = tmp_path / "outputs.json"
    path.write_text(json.dumps({"vpc_id": "vpc-1"}))
    done = _run([str(SCRIPT), "--list"], _ansible_env(path))
    assert done.returncode == 1
    assert "no `ansible_inventory`" in done.stderr


def test_script_explains_an_unreadable_file(tmp_path):
    done = _run([str(SCRIPT), "--list"], _ansible_env(tmp_path / "absent.json"))
    assert done.returncode == 1
    assert "cannot be read" in done.stderr


def test_script_host_mode(saved_outputs):
    done = _run([str(SCRIPT), "--host", "sd3-gpu-01"], _ansible_env(saved_outputs))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["efa_interfaces"] == 32


def test_script_writes_the_known_hosts_the_ssh_options_name(saved_outputs):
    env = _ansible_env(saved_outputs)
    done = _run([str(SCRIPT), "--list"], env)
    assert done.returncode == 0, done.stderr
    inventory = json.loads(done.stdout)
    path = inventory["all"]["vars"]["pulumi_known_hosts_file"]
    assert path == env["SD3_KNOWN_HOSTS"]
    lines = open(path, encoding="utf-8").read().splitlines()
    assert lines == inventory["all"]["vars"]["pulumi_known_hosts"] and len(lines) == 5
    head = inventory["_meta"]["hostvars"]["sd3-head"]
    # The head is known by its public address (how Ansible reaches it), its private one and its name.
    assert lines[0].startswith(f"{head['ansible_host']},{head['cluster_address']},sd3-head ssh-ed25519 ")
    # ssh-keygen finds every host in it: the file is in OpenSSH's known_hosts format.
    found = subprocess.run(["ssh-keygen", "-F", "sd3-gpu-03", "-f", path], capture_output=True, text=True, check=False)
    assert found.returncode == 0 and "ssh-ed25519" in found.stdout


def _loopback(outputs_path):
    """The saved outputs with every address replaced by a loopback one (and the network by 127.0.0.0/8), so
    that nothing the test runs could reach a machine; host names, keys and the file system stay as made."""
    text = outputs_path.read_text()
    outputs = json.loads(text)
    inventory = outputs["ansible_inventory"]
    addresses = sorted({v for host in inventory["_meta"]["hostvars"].values()
                        for k, v in host.items() if k in ("ansible_host", "cluster_address")})
    for index, address in enumerate(addresses, start=2):
        text = text.replace(f'{address}"', f'127.0.0.{index}"').replace(f"{address},", f"127.0.0.{index},") \
                   .replace(f"{address} ", f"127.0.0.{index} ")
    text = text.replace('"10.42.0.0/16"', '"127.0.0.0/8"')
    outputs_path.write_text(text)
    return addresses


PREFLIGHT_PLAY = """
- name: Preflight's inventory check of the cloud inventory
  hosts: all
  gather_facts: false
  tasks:
    - name: Check the inventory as preflight.yml does
      ansible.builtin.include_role:
        name: preflight
        tasks_from: inventory

    - name: Say which layout passed
      ansible.builtin.debug:
        msg: "backend={{ cluster_storage_backend }} gpus={{ hostvars[groups.gpu_nodes[0]].cluster_gpus_per_node }}"
      run_once: true
"""


def _preflight(outputs_path, *extra: str) -> subprocess.CompletedProcess[str]:
    play = outputs_path.parent / "preflight_inventory.yml"
    play.write_text(PREFLIGHT_PLAY)
    return _run([str(ANSIBLE_BIN / "ansible-playbook"), "-i", str(REPO / "inventories" / "cloud"), str(play),
                 "-e", "ansible_connection=local", *extra], _ansible_env(outputs_path))


@pytest.mark.parametrize(("shared", "backend"), [("fsx-lustre", "fsx_lustre"), ("efs", "efs"), ("none", "nfs")])
def test_generated_inventory_passes_preflight(pulumi_mocks, tmp_path, shared, backend):
    """The inventory exactly as the stack makes it (addresses moved to loopback) passes preflight's check of the
    inventory as a whole: groups, addresses, every cluster_* value, every role variable the stack sets
    (efa_interfaces, cluster_gpus_per_node, ...) against its spec, and the storage backend."""
    outputs = _saved_outputs(tmp_path, sharedFileSystem=shared)
    original = _loopback(outputs)
    assert "10.42.128.10" in original and "127.0.0." not in "".join(original)
    done = _preflight(outputs)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "ok=" in done.stdout and "failed=0" in done.stdout
    assert f"backend={backend} gpus=8" in done.stdout


@pytest.mark.parametrize(("extra", "message"), [
    (["-e", '{"cluster_shared_filesystem": {"dns_name": "fs-0123.fsx.us-east-1.amazonaws.com"}}'],
     "cluster_storage_backend is fsx_lustre but cluster_shared_filesystem has no mount_name"),
    (["-e", '{"cluster_storage_backend": "gluster"}'], "cluster_storage_backend is 'gluster': choose one of"),
])
def test_preflight_stops_a_broken_cloud_inventory(pulumi_mocks, tmp_path, extra, message):
    outputs = _saved_outputs(tmp_path)
    _loopback(outputs)
    done = _preflight(outputs, *extra)
    assert done.returncode != 0
    assert message in done.stdout, done.stdout[-3000:]
    assert "nothing was changed" in done.stdout
