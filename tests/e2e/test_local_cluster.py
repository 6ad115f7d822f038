"""The local cluster of `make demo`, end to end: nodes that behave like servers, site.yml green and
idempotent on them, and a cluster-down that removes only what cluster-up made.

Needs `make cluster-up` first (the `e2e` target does it); marked `cluster` so `make unit` skips it.
"""
from __future__ import annotations

import json
import re

import pytest
from e2e_support import BIN, INVENTORY, REPO, inventory, playbook, run

pytestmark = pytest.mark.cluster


def test_inventory_has_the_groups_and_a_single_head():
    children = inventory()["all"]["children"]
    assert set(children) >= {"head", "gpu_nodes", "storage_nodes"}
    assert list(children["head"]["hosts"]) == ["node1"]
    assert len(children["storage_nodes"]["hosts"]) % inventory()["all"]["vars"]["cluster_storage_replica"] == 0


def test_nodes_answer_over_ssh_with_strict_host_keys():
    """Ansible reaches the nodes as servers: SSH on their addresses, a key, known host keys."""
    inv = inventory()
    key = inv["all"]["vars"]["ansible_ssh_private_key_file"]
    known_hosts = REPO / ".cluster" / "known_hosts"
    for name, host in inv["all"]["hosts"].items():
        result = run("ssh", "-i", key, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                     "-o", f"UserKnownHostsFile={known_hosts}", f"root@{host['ansible_host']}",
                     "hostname; systemctl is-system-running; ip -o link show eth0", timeout=60)
        lines = result.stdout.splitlines()
        assert lines[0] == name
        assert lines[1] in ("running", "degraded"), f"{name}: systemd is {lines[1]}"
        assert "mtu 9000" in lines[2]


def test_host_keys_differ_between_nodes():
    """Each node makes its own host keys at first boot: none are baked into the image."""
    keys = [line.split()[2] for line in (REPO / ".cluster" / "known_hosts").read_text().splitlines()
            if " ssh-ed25519 " in line]
    assert len(keys) == len(inventory()["all"]["hosts"])
    assert len(set(keys)) == len(keys)


@pytest.mark.full
def test_site_yml_is_green_then_changes_nothing():
    first = playbook("site.yml")
    # localhost: the control machine's own check that the inventory lists hosts (it contacts no node).
    assert set(first.recap) == set(inventory()["all"]["hosts"]) | {"localhost"}
    second = playbook("site.yml")
    second.assert_unchanged("the second run of site.yml")
    # The no-op time is a number benchmarks/local_cluster.md follows (a refactor must not make it slower).
    print(f"\n[e2e] site.yml: first run {first.seconds:.0f} s, no-op run {second.seconds:.0f} s")


@pytest.mark.full
def test_verify_yml_is_green_and_writes_its_report():
    before = set((REPO / "reports").glob("verify-*.json")) if (REPO / "reports").exists() else set()
    result = playbook("ansible/playbooks/verify.yml", timeout=1800)
    assert "checks:" in result.stdout and " 0 failed" in result.stdout, result.stdout[-3000:]
    reports = set((REPO / "reports").glob("verify-*.json")) - before
    assert len(reports) == 1
    report = json.loads(reports.pop().read_text())
    assert report["passed"] is True
    layers = {check["layer"] for check in report["checks"]}
    assert {"ssh", "storage", "network", "training", "workloads"} <= layers
    hosts = set(inventory()["all"]["hosts"])
    ssh_hosts = {check["host"] for check in report["checks"] if check["layer"] == "ssh" and check["passed"]}
    assert ssh_hosts == hosts
    # The Slurm training run spanned every gpu_node and left its last checkpoint on the shared volume.
    gpu_nodes = len(inventory()["all"]["children"]["gpu_nodes"]["hosts"])
    (training,) = [c for c in report["checks"] if c["layer"] == "training"]
    assert training["passed"] and f"{gpu_nodes} nodes" in training["check"], training
    assert re.fullmatch(rf"job \d+, {gpu_nodes} ranks", training["detail"]), training  # one rank per CPU node
    # sd3cluster verify ran across them and each of its checks is a row of the report.
    workloads = {c["check"]: c for c in report["checks"] if c["layer"] == "workloads"}
    assert workloads["sd3cluster verify report"]["value"] == gpu_nodes, workloads
    assert {"allreduce_inter_node", "parameters_identical_on_ranks", "resume_exact"} <= set(workloads), workloads


def test_apt_on_nodes_goes_through_the_shared_cache():
    inv = inventory()
    key = inv["all"]["vars"]["ansible_ssh_private_key_file"]
    result = run("ssh", "-i", key, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                 "-o", f"UserKnownHostsFile={REPO / '.cluster' / 'known_hosts'}",
                 f"root@{inv['all']['hosts']['node1']['ansible_host']}", "apt-config dump Acquire::http::Proxy")
    assert re.search(r'Acquire::http::Proxy "http://[\d.]+:3142"', result.stdout), result.stdout


def test_cluster_down_removes_only_what_cluster_up_made():
    """A container and a network that are not ours survive cluster-down; then the cluster comes back."""
    nodes = len(inventory()["all"]["hosts"])
    image = run("bash", "localcluster/node-image.sh", "--print-tag").stdout.strip()
    run("podman", "network", "create", "sd3-test-bystander-net")
    run("podman", "run", "-d", "--name", "sd3-test-bystander", "--network", "sd3-test-bystander-net",
        image, "sleep", "600")
    try:
        run(str(BIN / "python"), "localcluster/cluster.py", "down")
        nodes_left = run("podman", "ps", "-a", "--filter", "label=io.sd3-cluster.role=node", "--format", "{{.Names}}")
        assert nodes_left.stdout.strip() == ""
        assert run("podman", "container", "exists", "sd3-test-bystander", check=False).returncode == 0
        assert run("podman", "network", "exists", "sd3-test-bystander-net", check=False).returncode == 0
        assert not INVENTORY.exists()
    finally:
        run("podman", "rm", "-f", "-t", "0", "sd3-test-bystander", check=False)
        run("podman", "network", "rm", "-f", "sd3-test-bystander-net", check=False)
        run(str(BIN / "python"), "localcluster/cluster.py", "up", "--nodes", str(nodes))
    assert inventory()["all"]["hosts"]
