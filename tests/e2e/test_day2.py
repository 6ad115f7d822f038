"""Day 2 on the local cluster, end to end: scale-out 3 -> 4 then a green verify on 4 nodes; remove_node
4 -> 3 keeps the shared volume's data and verify stays green; a rolling upgrade drains one gpu node at a
time and gives each back, and a failing upgrade stops at its first node, leaving it drained.

The tests run in this order and each leaves the cluster as the next expects (3 nodes, converged, at
the end). Run them under the cluster's lock: `flock /tmp/sd3-local-cluster.lock make e2e-full`.
"""
from __future__ import annotations

import json
import re
import time
import uuid

import pytest
from e2e_support import REPO, cluster_up, host, hosts, node, playbook

MARKER = "/etc/sd3-cluster/converged.json"

pytestmark = [pytest.mark.cluster, pytest.mark.full]


def slurm_states() -> dict[str, str]:
    """{node: Slurm state} as the controller on node1 sees them."""
    lines = node("node1", 'sinfo --noheader --Node --format "%N %t"').splitlines()
    return dict(line.split() for line in lines)


def verify_green(expected_hosts: list[str]) -> None:
    result = playbook("ansible/playbooks/verify.yml", timeout=1800)
    assert "checks:" in result.stdout and " 0 failed" in result.stdout, result.stdout[-3000:]
    report = sorted((REPO / "reports").glob("verify-*.json"))[-1]
    data = json.loads(report.read_text())
    assert data["passed"] is True
    ssh_hosts = {check["host"] for check in data["checks"] if check["layer"] == "ssh" and check["passed"]}
    assert ssh_hosts == set(expected_hosts), f"verify's SSH checks passed on {ssh_hosts}, not {expected_hosts}"


@pytest.fixture(scope="module", autouse=True)
def three_converged_nodes():
    """Start from 3 nodes that carry the converged marker (site.yml once if one lacks it)."""
    cluster_up(3)
    if any(not host(name).file(MARKER).exists for name in hosts()):
        playbook("site.yml")
    yield
    cluster_up(3)


def test_scale_out_stops_when_nothing_is_new():
    result = playbook("scale_out.yml", check=False)
    assert result.rc != 0
    assert "Nothing to scale out" in result.stdout, result.stdout[-3000:]
    result.assert_unchanged("scale_out.yml with nothing new")


def test_scale_out_3_to_4_then_verify_on_4_nodes():
    cluster_up(4)
    assert not host("node4").file(MARKER).exists
    started = time.monotonic()
    result = playbook("scale_out.yml")
    seconds = time.monotonic() - started
    hosts_recap = result.recap
    # localhost: the control machine's own check that the inventory lists hosts (it contacts no node).
    assert set(hosts_recap) == {"localhost", "node1", "node2", "node3", "node4"}
    assert "new nodes node4 get the whole stack" in result.stdout
    # The new node got the whole stack; the others only what changes for them.
    assert hosts_recap["node4"]["changed"] > hosts_recap["node2"]["changed"], hosts_recap
    # The next job can use it: Slurm schedules on node4, it mounts the volume, names resolve everywhere.
    assert slurm_states().get("node4") == "idle", slurm_states()
    assert node("node1", "srun -N1 -w node4 hostname", check=False) == "node4"
    assert node("node4", "findmnt -n -o FSTYPE /shared") == "fuse.glusterfs"
    assert re.search(r"\bnode4\b", node("node2", "getent hosts node4"))
    assert "node4" in node("node2", "cat /etc/ssh/ssh_known_hosts")
    assert '"gpu_nodes"' in node("node4", f"cat {MARKER}")
    # The scheduler layer ran whole on it: Slurm runs its health check program there.
    assert host("node4").file("/usr/local/sbin/sd3-node-health").is_file
    assert host("node4").file("/etc/sd3-node-health.json").is_file
    # It serves too: the head's balancer and Prometheus know its worker.
    assert host("node4").service("sd3-inference@0").is_running
    assert "10.213.0.104:8100 max_fails" in node("node1", "cat /etc/nginx/sd3-inference/upstream.conf")
    assert "10.213.0.104:8100" in node("node1", "cat /etc/prometheus/targets/sd3-inference.json")
    # Every node's firewall lets the new node in (its address is in the nodes' set).
    for name in ("node1", "node2", "node3", "node4"):
        assert "10.213.0.104" in node(name, "nft list set inet sd3_cluster_firewall nodes_v4"), name
    print(f"scale-out 3 -> 4 took {seconds:.0f} s")
    verify_green(["node1", "node2", "node3", "node4"])


def test_remove_node_stops_before_any_change_when_bricks_have_nowhere_to_go():
    assert len(hosts()) == 4
    result = playbook("remove_node.yml", "-e", "day2_remove_nodes=node3", check=False)
    assert result.rc != 0
    assert "node3 holds brick" in result.stdout, result.stdout[-3000:]
    assert "day2_remove_node_brick_targets" in result.stdout, result.stdout[-3000:]
    assert slurm_states().get("node3") == "idle", "node3 was drained although remove_node.yml stopped"


def test_remove_node_4_to_3_keeps_the_data_and_verify_stays_green():
    assert len(hosts()) == 4
    token = uuid.uuid4().hex
    node("node1", f"mkdir -p /shared/day2-test && echo {token} > /shared/day2-test/before-remove.txt")
    result = playbook("remove_node.yml", "-e", "day2_remove_nodes=node4")
    assert "node4 is out of the cluster" in result.stdout
    assert "node4" not in slurm_states(), slurm_states()
    for name in ("node1", "node2", "node3"):
        assert not re.search(r"\bnode4\b", node(name, "grep -v '^#' /etc/hosts")), f"node4 in /etc/hosts of {name}"
        assert "node4" not in node(name, "cat /etc/ssh/ssh_known_hosts"), f"node4 still in known_hosts of {name}"
        assert "node4" not in node(name, "cat /etc/slurm/slurm-nodes.conf")
    assert "10.213.0.104" not in node("node1", "cat /etc/prometheus/prometheus.yml")
    assert "10.213.0.104" not in node("node1", "cat /etc/nginx/sd3-inference/upstream.conf")
    assert "10.213.0.104" not in node("node1", "cat /etc/prometheus/targets/sd3-inference.json")
    for name in ("node1", "node2", "node3"):  # the firewalls that stay no longer let the removed node in
        assert "10.213.0.104" not in node(name, "nft list set inet sd3_cluster_firewall nodes_v4"), name
    assert not host("node4").service("sd3-inference@0").is_running
    assert not host("node4").service("slurmd").is_running
    assert node("node4", "findmnt -n /shared", check=False) == ""
    cluster_up(3)
    assert hosts() == ["node1", "node2", "node3"]
    assert node("node2", "cat /shared/day2-test/before-remove.txt") == token
    verify_green(["node1", "node2", "node3"])
    node("node1", "rm -rf /shared/day2-test")


def day2_lines(output: str) -> list[tuple[str, str, str]]:
    """(node, event, rest) for every `day2: NODE drained|resumed ...` line of the play output, in order."""
    return re.findall(r'"?day2: (node\d+) (drained|resumed|left drained)([^"\n]*)', output)


def test_rolling_upgrade_drains_one_gpu_node_at_a_time_and_resumes_each():
    result = playbook("rolling_upgrade.yml")
    events = day2_lines(result.stdout)
    assert [(name, event) for name, event, _ in events] == [
        ("node2", "drained"), ("node2", "resumed"), ("node3", "drained"), ("node3", "resumed")], events
    for name, event, rest in events:
        if event == "drained":
            drained = set(re.findall(r"(node\d+)=(?:drain|drng|drained)", rest))
            assert drained == {name}, f"while {name} was upgraded Slurm had {rest.strip()}"
    assert "GPU check skipped: no NVIDIA GPU device" in result.stdout
    assert slurm_states() == {"node2": "idle", "node3": "idle"}


def test_rolling_upgrade_stops_at_the_first_failure_leaving_it_drained():
    # Debian 12 ships CUDA 11.8: asking the distribution for 12.8 fails on the first node.
    result = playbook("rolling_upgrade.yml", "-e", "cuda_toolkit_version=12.8", check=False)
    try:
        assert result.rc != 0
        assert "rolling upgrade stopped at node2" in result.stdout, result.stdout[-3000:]
        events = [(name, event) for name, event, _ in day2_lines(result.stdout)]
        assert events == [("node2", "drained")], events
        states = slurm_states()
        assert states["node2"] in ("drain", "drng"), states
        assert states["node3"] == "idle", states
        assert result.recap.get("node3", {"changed": 0})["changed"] == 0, result.recap
    finally:
        node("node1", "scontrol update NodeName=node2 State=RESUME", check=False)
