"""The tuned network as each node holds it: link MTU, the sysctl profile and what the node's network namespace
applied, NCCL's and Gloo's interface, and the MTU persisted by the node's own network configuration tool."""

import json

import pytest

PROFILE = "/etc/sysctl.d/60-sd3-network-tuning.conf"


def node(host) -> str:
    return host.backend.get_hostname()


def test_eth0_runs_mtu_9000(host):
    """node1 started at 1500: the role raised it."""
    link = json.loads(host.check_output("ip -json link show dev eth0"))[0]
    assert link["mtu"] == 9000


def test_profile_sizes_buffers_for_100_gbits(host):
    """100 Gbit/s x 1 ms = 12.5 MB in flight; twice that, rounded up to a power of two, is 32 MiB. The global keys
    are in the file too (a container cannot apply them; a real node does at boot)."""
    lines = host.file(PROFILE).content_string.splitlines()
    for line in ("net.core.rmem_max = 33554432", "net.core.netdev_max_backlog = 250000",
                 "net.ipv4.tcp_rmem = 4096 131072 33554432", "net.ipv4.tcp_mtu_probing = 1"):
        assert line in lines


def test_namespace_keys_are_applied(host):
    keys = ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.ipv4.tcp_mtu_probing", "net.ipv4.tcp_slow_start_after_idle")
    values = [" ".join(line.split()) for line in host.check_output("sysctl -n " + " ".join(keys)).splitlines()]
    assert values == ["4096 131072 33554432", "4096 65536 33554432", "1", "0"]


def test_nccl_and_gloo_use_the_cluster_interface(host):
    conf = host.file("/etc/nccl.conf").content_string.splitlines()
    assert "NCCL_SOCKET_IFNAME=eth0" in conf
    assert "NCCL_DEBUG=WARN" in conf
    login_env = host.check_output("bash -lc 'echo $NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME $NCCL_IB_DISABLE'")
    assert login_env.split() == ["eth0", "eth0", "1"]


def test_the_node_persists_mtu_9000_with_its_own_tool(host):
    """node2 configures eth0 with ifupdown, node3 with netplan (prepare made them so); node1 has neither."""
    name = node(host)
    if name == "network-node2":
        assert "mtu: 9000" in host.check_output("ifquery eth0").splitlines()
    elif name == "network-node3":
        assert host.check_output("netplan get ethernets.eth0.mtu").strip() == "9000"
    else:
        pytest.skip(f"{name} has no ifupdown or netplan configuration of eth0")
