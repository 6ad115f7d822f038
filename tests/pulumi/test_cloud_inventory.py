"""The Ansible inventory made from pulumi/aws outputs: the pure function, and inventories/cloud with Ansible."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from sd3_aws.config import parse_config
from sd3_aws.inventory import HostRecord, build_inventory, storage_layout
from sd3_aws.stack import build
from sd3_pulumi_testing import AWS_VALUES, REPO, declare

SCRIPT = REPO / "inventories" / "cloud" / "pulumi_inventory.py"
ANSIBLE_BIN = REPO / ".venv" / "bin"


@pytest.mark.parametrize(("nodes", "replica", "bricks"), [(1, 1, 1), (2, 2, 2), (3, 3, 3), (4, 3, 3), (7, 3, 6)])
def test_storage_layout(nodes, replica, bricks):
    names = [f"n{i}" for i in range(nodes)]
    got_replica, storage = storage_layout(names)
    assert (got_replica, len(storage)) == (replica, bricks)
    assert storage == names[:bricks]


def test_build_inventory_refuses_a_head_without_public_address():
    head = HostRecord(name="h", private_ip="10.0.0.5", instance_id="i-1", instance_type="m7i.large")
    with pytest.raises(ValueError, match="only SSH entry"):
        build_inventory(cluster_name="c", network_cidr="10.0.0.0/16", ssh_user="ubuntu", head=head, gpu_nodes=[])


@pytest.fixture
def saved_outputs(pulumi_mocks, tmp_path):
    """`pulumi stack output --json` of a mocked 4-node stack, saved as a user would save it."""
    config = parse_config({**AWS_VALUES, "gpuNodeCount": 4})
    outputs = declare(lambda: __import__("pulumi").Output.all(**build(config)))
    path = tmp_path / "outputs.json"
    path.write_text(json.dumps(outputs))
    return path


def _ansible_env(outputs_path) -> dict[str, str]:
    env = dict(os.environ, SD3_PULUMI_OUTPUTS=str(outputs_path), ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
               ANSIBLE_FACT_CACHING="memory")
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
    assert listed["storage_nodes"]["hosts"] == ["sd3-gpu-01", "sd3-gpu-02", "sd3-gpu-03"]
    hostvars = listed["_meta"]["hostvars"]
    assert set(hostvars) == {"sd3-head", "sd3-gpu-01", "sd3-gpu-02", "sd3-gpu-03", "sd3-gpu-04"}
    assert "ProxyCommand" in hostvars["sd3-gpu-01"]["ansible_ssh_common_args"]
    assert hostvars["sd3-head"]["ansible_host"] != hostvars["sd3-head"]["cluster_address"]


def test_group_vars_resolve_to_the_stack_values(saved_outputs):
    """The inventory directory (script + group_vars/all.yml) gives the project's cluster_* variables."""
    message = ("{{ cluster_name }}|{{ cluster_network_cidr }}|{{ cluster_mtu }}|{{ cluster_storage_backend }}|"
               "{{ cluster_storage_replica }}|{{ cluster_shared_filesystem.type }}|{{ cluster_address }}")
    done = _run([str(ANSIBLE_BIN / "ansible"), "-i", str(REPO / "inventories" / "cloud"), "sd3-gpu-02", "-o",
                 "-m", "ansible.builtin.debug", "-a", f"msg={message}"], _ansible_env(saved_outputs))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sd3|10.42.0.0/16|9001|glusterfs|3|lustre|10.42.128." in done.stdout


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
    assert json.loads(done.stdout)["aws_instance_type"] == "p5.48xlarge"
