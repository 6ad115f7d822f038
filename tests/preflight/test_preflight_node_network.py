"""Unit tests of preflight's node and network rules (preflight_node_problems, preflight_network_problems in
ansible/plugins/filter/preflight.py) on the output of the role's probe_node.py and ping_peers.py."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("preflight_filter_node_network",
                                              REPO / "ansible" / "plugins" / "filter" / "preflight.py")
pf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pf)

# probe_node.py on a training node that meets the role's defaults.
FIT = {"cpu_cores": 64, "memory_gb": 512.0, "disk_path": "/data", "disk_free_gb": 3500.25, "disk_device": "nvme0n1",
       "disk_rotational": False, "nvidia_gpus": 8}
# The role's defaults (roles/preflight/defaults/main.yml), as tasks/node.yml passes them.
DEFAULTS = {"min_cpu_cores": 8, "min_memory_gb": 32, "min_free_disk_gb": 1000, "data_path": "/data",
            "require_ssd": True, "require_gpus": True, "min_gpus_per_node": 1, "gpus_per_node": 0}
GROUPS = {"all": ["head1", "gpu1"], "head": ["head1"], "gpu_nodes": ["gpu1"]}


def node_problems(host="gpu1", groups=GROUPS, **changes):
    node = dict(FIT, **{key: value for key, value in changes.items() if key in FIT})
    settings = dict(DEFAULTS, **{key: value for key, value in changes.items() if key not in FIT})
    return pf.node_problems(node, host, groups, settings)


def test_a_fit_node_has_no_problems():
    assert node_problems() == []
    assert node_problems(host="head1") == []


def test_too_few_cpu_cores():
    assert node_problems(cpu_cores=4) == [
        "4 CPU cores, needs at least 8 (preflight_min_cpu_cores): use a larger machine or lower the threshold in "
        "group_vars"]


def test_too_little_memory_is_said_to_a_tenth_of_a_gb():
    assert node_problems(memory_gb=15.6789) == [
        "15.7 GB of memory, needs at least 32 (preflight_min_memory_gb): add memory or lower the threshold"]


def test_too_little_free_disk_names_the_data_path_and_where_it_was_measured():
    assert node_problems(disk_free_gb=120.04, disk_path="/") == [
        "120.0 GB free under /data (checked at /), needs at least 1000 (preflight_min_free_disk_gb): free space, "
        "point preflight_data_path at the data disk, or lower the threshold"]


def test_a_rotational_data_disk_only_when_ssd_is_required():
    message = ("the data disk under /data (sda) is a rotational disk (preflight_require_ssd): put the data on an SSD "
               "or NVMe drive")
    assert node_problems(disk_rotational=True, disk_device="sda") == [message]
    assert node_problems(disk_rotational=True, disk_device="sda", require_ssd=False) == []
    # probe_node.py says null when it cannot tell (a container's overlay, a network file system): not refused.
    assert node_problems(disk_rotational=None, disk_device=None) == []


def test_too_few_gpus_on_a_gpu_node():
    assert node_problems(nvidia_gpus=0) == [
        "0 NVIDIA GPU(s) on the PCI bus, needs at least 1 (preflight_min_gpus_per_node): check the GPUs are seated "
        "and enabled in the BIOS, or move this host out of gpu_nodes"]
    assert node_problems(nvidia_gpus=0, require_gpus=False) == []
    # Only gpu_nodes need GPUs; an inventory without the group has none.
    assert node_problems(host="head1", nvidia_gpus=0) == []
    assert node_problems(groups={"all": ["gpu1"]}, nvidia_gpus=0) == []


def test_fewer_gpus_than_the_inventory_promises_whatever_require_gpus_says():
    message = ("7 NVIDIA GPU(s) on the PCI bus, the inventory promises 8 (cluster_gpus_per_node): reseat or replace "
               "the missing GPUs (look for XID 79 in dmesg), or correct cluster_gpus_per_node for this host")
    assert node_problems(nvidia_gpus=7, gpus_per_node=8) == [message]
    assert node_problems(nvidia_gpus=7, gpus_per_node=8, require_gpus=False) == [message]
    # The promise replaces the minimum: one message, not two.
    assert node_problems(nvidia_gpus=7, gpus_per_node=8, min_gpus_per_node=8) == [message]
    assert node_problems(nvidia_gpus=8, gpus_per_node=8) == []
    assert node_problems(host="head1", nvidia_gpus=0, gpus_per_node=8) == []


def test_every_threshold_missed_is_listed_in_order():
    problems = node_problems(cpu_cores=2, memory_gb=3.0, disk_free_gb=10.0, disk_rotational=True, nvidia_gpus=0)
    variables = ["preflight_min_cpu_cores", "preflight_min_memory_gb", "preflight_min_free_disk_gb",
                 "preflight_require_ssd", "preflight_min_gpus_per_node"]
    assert all(f"({variable})" in problem for problem, variable in zip(problems, variables, strict=True))


@pytest.mark.parametrize("threshold", ["8", 8.0])
def test_thresholds_given_as_text_or_float_compare_as_numbers(threshold):
    """-e preflight_min_cpu_cores=8 arrives as text; the role's argument spec accepts it, so the rule compares
    numbers, read as the spec reads them."""
    assert node_problems(cpu_cores=8, min_cpu_cores=threshold) == []
    assert node_problems(cpu_cores=7, min_cpu_cores=threshold)[0].startswith(
        f"7 CPU cores, needs at least {threshold} (preflight_min_cpu_cores)")
    assert node_problems(gpus_per_node="8", nvidia_gpus=7)[0].startswith("7 NVIDIA GPU(s) on the PCI bus, the "
                                                                         "inventory promises 8")


def test_switches_given_as_text_are_read_as_the_spec_reads_them():
    assert node_problems(disk_rotational=True, require_ssd="no") == []
    assert node_problems(disk_rotational=True, require_ssd="yes") != []
    assert node_problems(nvidia_gpus=0, require_gpus="false") == []


def test_a_value_the_argument_spec_refuses_is_not_read_as_zero():
    """Jinja's int filter read 'lots' as 0, which no node misses; the spec stops it first, and the rule too."""
    with pytest.raises(TypeError, match="'lots'"):
        node_problems(min_cpu_cores="lots")


# ping_peers.py from node a to its peers.
def ping(peer="b", address="10.0.0.2", **changes):
    return dict({"peer": peer, "address": address, "reachable": True, "rtt_avg_ms": 0.12, "mtu_payload": 8972,
                 "mtu_ok": True, "error": None}, **changes)


SETTINGS = {"max_rtt_ms": 1.0, "mtu": 9000}


def test_a_fit_network_has_no_problems():
    assert pf.network_problems([ping(), ping("c", "10.0.0.3")], "a", SETTINGS) == []
    assert pf.network_problems([], "a", SETTINGS) == []


def test_ping_missing_on_the_node():
    """ping_peers.py's report when ping is not installed carries only the peer, the address and the error."""
    report = {"peer": "b", "address": "10.0.0.2", "error": "ping is not installed on this node: install iputils-ping"}
    assert pf.network_problems([report], "a", SETTINGS) == [
        "a -> b (10.0.0.2): ping is not installed on this node: install iputils-ping"]


def test_no_answer():
    assert pf.network_problems([ping(reachable=False, rtt_avg_ms=None, mtu_ok=False)], "a", SETTINGS) == [
        "a -> b (10.0.0.2): no answer to ping: check that the node is up and that ICMP is allowed between nodes"]


def test_slow_pair_and_jumbo_frames_dropped_are_both_said():
    assert pf.network_problems([ping(rtt_avg_ms=1.23456, mtu_ok=False)], "a", SETTINGS) == [
        "a -> b (10.0.0.2): round trip 1.235 ms, above 1.0 ms (preflight_max_rtt_ms): put the nodes on one switch "
        "or raise the threshold",
        "a -> b (10.0.0.2): a ping of 8972 bytes with don't-fragment (cluster_mtu 9000 minus 28) did not pass: set "
        "MTU 9000 on both interfaces and the switch ports, or lower cluster_mtu"]


def test_the_threshold_is_strict_and_compared_as_a_number():
    assert pf.network_problems([ping(rtt_avg_ms=1.0)], "a", SETTINGS) == []
    assert pf.network_problems([ping(rtt_avg_ms=1.5)], "a", {"max_rtt_ms": "2", "mtu": 9000}) == []
    assert "above 2 ms" in pf.network_problems([ping(rtt_avg_ms=2.5)], "a", {"max_rtt_ms": "2", "mtu": 9000})[0]


def test_only_failing_pairs_are_listed_each_once():
    pings = [ping(), ping("c", "10.0.0.3", mtu_ok=False, mtu_payload=1472), ping("d", "10.0.0.4", reachable=False)]
    problems = pf.network_problems(pings, "a", {"max_rtt_ms": 1.0, "mtu": 1500})
    assert [problem.split(":")[0] for problem in problems] == ["a -> c (10.0.0.3)", "a -> d (10.0.0.4)"]
    assert "a ping of 1472 bytes with don't-fragment (cluster_mtu 1500 minus 28)" in problems[0]


def test_the_filters_are_offered_to_ansible():
    filters = pf.FilterModule().filters()
    assert filters["preflight_node_problems"] is pf.node_problems
    assert filters["preflight_network_problems"] is pf.network_problems
