"""The loopback inventory the preflight tests start from, and how they run the preflight playbook on it.

The "nodes" are this machine reached with the local connection under three loopback addresses
(127.0.0.1-3), so the real role runs (its probes and its pings) without containers.
"""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PLAYBOOK = REPO / "ansible" / "playbooks" / "preflight.yml"

GOOD = {
    "all": {
        "vars": {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "cluster_name": "test",
            "cluster_network_cidr": "127.0.0.0/8",
            "cluster_mtu": 9000,
            "cluster_storage_backend": "glusterfs",
            "cluster_storage_replica": 3,
            "cluster_storage_bricks_per_node": 1,
            "preflight_min_cpu_cores": 1,
            "preflight_min_memory_gb": 0.5,
            "preflight_min_free_disk_gb": 0.1,
            "preflight_require_ssd": False,
            "preflight_require_gpus": False,
            "preflight_max_rtt_ms": 50,
            "preflight_ping_count": 1,
        },
        "hosts": {
            "n1": {"ansible_host": "127.0.0.1"},
            "n2": {"ansible_host": "127.0.0.2"},
            "n3": {"ansible_host": "127.0.0.3"},
        },
        "children": {
            "head": {"hosts": {"n1": None}},
            "gpu_nodes": {"hosts": {"n2": None, "n3": None}},
            "storage_nodes": {"hosts": {"n1": None, "n2": None, "n3": None}},
        },
    }
}


def run_preflight(tmp_path: Path, inventory: dict | Path, *args: str) -> subprocess.CompletedProcess:
    """preflight.yml on `inventory` (a dict written to tmp_path, or an inventory path) with extra arguments."""
    if isinstance(inventory, dict):
        path = tmp_path / "hosts.yml"
        path.write_text(yaml.safe_dump(inventory))
        inventory = path
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_CACHE_PLUGIN="memory")
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), str(PLAYBOOK), *args],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)


def variant(**changes) -> dict:
    """The good inventory with changes: keys are paths like 'vars.cluster_mtu' or 'hosts.n2.ansible_host';
    a value of None deletes the key."""
    inventory = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        node = inventory["all"]
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return inventory


def assert_stopped_cleanly(output: str) -> None:
    """No Python traceback, no Ansible internal error, and a recap in which no host changed anything."""
    assert "Traceback" not in output and "Unexpected Exception" not in output, output
    recap = re.findall(r"^\S+\s+: ok=\d+\s+changed=(\d+)", output, flags=re.MULTILINE)
    assert recap and set(recap) == {"0"}, output  # preflight never changes a node
