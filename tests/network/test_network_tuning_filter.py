"""The network_tuning filters: the sysctl profile sized to bandwidth x RTT, which keys a container may
apply, and where the cluster interface is found (Ansible facts, netplan, ifupdown)."""

import base64
import importlib.util
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[2] / "ansible" / "plugins" / "filter" / "network_tuning.py"
spec = importlib.util.spec_from_file_location("network_tuning_filter", PLUGIN)
nt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nt)

MIB = 1 << 20


@pytest.mark.parametrize(
    ("speed", "rtt_ms", "buffer"),
    [
        (10, 1.0, 16 * MIB),  # 1.25 MB in flight: the 16 MiB floor
        (25, 1.0, 16 * MIB),  # 2 x 3.125 MB = 6.25 MB: still the floor
        (100, 1.0, 32 * MIB),  # 2 x 12.5 MB = 25 MB -> 32 MiB
        (200, 1.0, 64 * MIB),  # 2 x 25 MB = 50 MB -> 64 MiB
        (400, 1.0, 128 * MIB),  # 2 x 50 MB = 100 MB -> 128 MiB
        (400, 50.0, 1024 * MIB),  # 5 GB wanted: capped at 1 GiB
    ],
)
def test_buffers_are_twice_the_bandwidth_delay_product(speed, rtt_ms, buffer):
    profile = nt.sysctl_profile(speed, rtt_ms)
    assert profile["net.core.rmem_max"] == str(buffer)
    assert profile["net.core.wmem_max"] == str(buffer)
    assert profile["net.ipv4.tcp_rmem"] == f"4096 131072 {buffer}"
    assert profile["net.ipv4.tcp_wmem"] == f"4096 65536 {buffer}"


def test_bandwidth_delay_product():
    assert nt.bandwidth_delay_bytes(100, 1.0) == 12_500_000
    assert nt.bandwidth_delay_bytes(10, 0.1) == 125_000


def test_backlog_grows_with_speed():
    backlogs = [int(nt.sysctl_profile(s)["net.core.netdev_max_backlog"]) for s in nt.SPEEDS_GBPS]
    assert backlogs == sorted(backlogs)
    assert backlogs[0] == 30000 and backlogs[-1] == 250000


def test_profile_settings_and_busy_polling():
    profile = nt.sysctl_profile(100, congestion_control="bbr", mtu_probing=2)
    assert profile["net.ipv4.tcp_congestion_control"] == "bbr"
    assert profile["net.ipv4.tcp_mtu_probing"] == "2"
    assert profile["net.ipv4.tcp_slow_start_after_idle"] == "0"
    assert "net.core.busy_poll" not in profile
    polled = nt.sysctl_profile(100, busy_poll_us=50)
    assert polled["net.core.busy_poll"] == polled["net.core.busy_read"] == "50"


def test_overrides_replace_add_and_remove_keys():
    profile = nt.sysctl_profile(25, overrides={"net.core.somaxconn": 1024, "net.ipv4.tcp_ecn": 1,
                                               "net.core.default_qdisc": "", "net.ipv4.tcp_no_metrics_save": None})
    assert profile["net.core.somaxconn"] == "1024"
    assert profile["net.ipv4.tcp_ecn"] == "1"
    assert "net.core.default_qdisc" not in profile
    assert "net.ipv4.tcp_no_metrics_save" not in profile


def test_values_have_single_spaces():
    profile = nt.sysctl_profile(10, overrides={"net.ipv4.ip_local_port_range": "1024\t  65000"})
    assert profile["net.ipv4.ip_local_port_range"] == "1024 65000"


@pytest.mark.parametrize(("speed", "rtt"), [(7, 1.0), (100, 0), (100, 500), ("fast", 1.0)])
def test_bad_input_is_refused_with_the_value(speed, rtt):
    with pytest.raises(nt.NetworkTuningError, match=str(speed) if speed != 100 else "RTT"):
        nt.sysctl_profile(speed, rtt)


def test_containers_apply_only_network_namespace_keys():
    profile = nt.sysctl_profile(100, overrides={"vm.swappiness": 10, "kernel.numa_balancing": 0})
    applied = nt.sysctl_applicable(profile, True)
    assert applied and all(k.startswith(("net.ipv4.", "net.ipv6.")) for k in applied)
    assert "net.core.rmem_max" not in applied and "vm.swappiness" not in applied
    assert nt.sysctl_applicable(profile, False) == profile


FACTS = {
    "interfaces": ["lo", "eth0", "ib0", "bond-data"],
    "lo": {"ipv4": {"address": "127.0.0.1"}, "mtu": 65536},
    "eth0": {"ipv4": {"address": "192.168.1.5"}, "mtu": 1500, "macaddress": "aa:bb:cc:00:00:01"},
    "ib0": {"ipv4": {"address": "10.10.0.7"}, "mtu": 2044, "macaddress": "aa:bb:cc:00:00:02"},
    "bond_data": {"ipv4": {"address": "10.20.0.2"}, "ipv4_secondaries": [{"address": "10.10.0.9"}],
                  "mtu": 9000, "macaddress": "aa:bb:cc:00:00:03"},
}


def test_cluster_interface_prefers_the_cluster_address():
    found = nt.cluster_interface(FACTS, "10.10.0.0/24", "10.10.0.9")
    assert found == {"name": "bond-data", "address": "10.10.0.9", "mtu": 9000, "macaddress": "aa:bb:cc:00:00:03"}


def test_cluster_interface_falls_back_to_the_network():
    assert nt.cluster_interface(FACTS, "10.10.0.0/24", "10.10.0.200")["name"] == "bond-data"
    assert nt.cluster_interface(FACTS, "192.168.1.0/24")["name"] == "eth0"


def test_cluster_interface_none_on_the_network():
    assert nt.cluster_interface(FACTS, "172.16.0.0/16", "172.16.0.1") == {}


def test_netplan_device_by_id_set_name_and_match():
    docs = [
        {"network": {"version": 2, "ethernets": {"ens5": {"dhcp4": True}}}},
        {"network": {"ethernets": {"nic1": {"match": {"macaddress": "x"}, "set-name": "data0"}},
                     "bonds": {"bond0": {"interfaces": ["ens6", "ens7"]}}}},
        {"network": {"vlans": {"v100": {"match": {"name": "eth0.100"}}}}},
        None,
    ]
    assert nt.netplan_device(docs, "ens5") == {"section": "ethernets", "id": "ens5"}
    assert nt.netplan_device(docs, "data0") == {"section": "ethernets", "id": "nic1"}
    assert nt.netplan_device(docs, "bond0") == {"section": "bonds", "id": "bond0"}
    assert nt.netplan_device(docs, "eth0.100") == {"section": "vlans", "id": "v100"}
    assert nt.netplan_device(docs, "eth9") == {}


def _slurped(source, text):
    return {"source": source, "content": base64.b64encode(text.encode()).decode()}


def test_ifupdown_file_finds_the_stanza():
    files = [
        _slurped("/etc/network/interfaces", "source /etc/network/interfaces.d/*\nauto lo\niface lo inet loopback\n"),
        {"skipped": True},
        _slurped("/etc/network/interfaces.d/eth0", "# eth0\niface eth0 inet manual\n    mtu 1500\n"),
        _slurped("/etc/network/interfaces.d/eth01", "iface eth01 inet dhcp\n"),
    ]
    assert nt.ifupdown_file(files, "eth0") == "/etc/network/interfaces.d/eth0"
    assert nt.ifupdown_file(files, "eth01") == "/etc/network/interfaces.d/eth01"
    assert nt.ifupdown_file(files, "eth1") == ""


# ------------------------------------------------------------------------------------ the role's inputs

GOOD_INPUTS = {"cidr": "10.213.0.0/24", "interface": "", "address": "10.213.0.41", "mtu": 9000, "mtu_persist": "auto"}
IFACES = ["lo", "eth0"]
PICKED = {"name": "eth0", "address": "10.213.0.41", "mtu": 9000, "macaddress": ""}


def problems(iface=PICKED, **changed):
    return nt.input_problems("node1", {**GOOD_INPUTS, **changed}, IFACES, iface, [1280, 9216],
                             ["auto", "netplan", "networkd", "ifupdown", "none"])


def test_good_inputs_have_no_problem_and_extra_vars_text_is_read():
    assert problems() == ""
    assert problems(mtu="1500", interface="eth0") == ""


@pytest.mark.parametrize("changed, iface, expected", [
    ({"cidr": "10.213.0.1/24"}, {}, "node1: nothing was changed. network_tuning_cidr (cluster_network_cidr) is "
     "'10.213.0.1/24', not a network: set it in group_vars/all, e.g. 10.10.0.0/24."),
    ({"interface": "ib0"}, PICKED, "node1: nothing was changed. network_tuning_interface is 'ib0' but this node has "
     "only eth0, lo: fix the name or set it to \"\" to detect it."),
    ({"cidr": "10.99.0.0/24"}, {}, "node1: nothing was changed. no interface has an address in network_tuning_cidr "
     "10.99.0.0/24 (this node's cluster_address is '10.213.0.41'): put the node on the cluster network, fix "
     "cluster_address, or name the interface in network_tuning_interface."),
    ({"mtu": 9500}, PICKED, "node1: nothing was changed. network_tuning_mtu (cluster_mtu) is 9500: use 1280 to 9216 "
     "(1500 plain Ethernet, 9000 jumbo frames)."),
    ({"mtu": "jumbo"}, PICKED, "network_tuning_mtu (cluster_mtu) is jumbo: use 1280 to 9216"),
    ({"mtu_persist": "nmcli"}, PICKED, "node1: nothing was changed. network_tuning_mtu_persist is 'nmcli': choose one "
     "of auto, netplan, networkd, ifupdown, none."),
])
def test_each_bad_input_is_named(changed, iface, expected):
    message = problems(iface=iface, **changed)
    assert expected in message, message
    assert message.count("nothing was changed") == 1


def test_a_bad_network_is_said_once_and_the_mtu_beside_it():
    message = problems(iface={}, cidr="not-a-network", mtu=100)
    assert "not a network" in message and "no interface has an address" not in message
    assert "network_tuning_mtu (cluster_mtu) is 100" in message
